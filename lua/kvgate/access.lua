-- The access phase, the only phase here that may do I/O: read the body, check what the gateway reads
-- of it, compute the request's features, ask the sidecar for a decision (or fall open), and leave the
-- candidates in ngx.ctx for the balancer.

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local failopen = require "kvgate.failopen"
local features = require "kvgate.features"
local protocol = require "kvgate.protocol"
local reports  = require "kvgate.reports"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"
local utf8     = require "kvgate.utf8"

local ngx        = ngx
local ngx_log    = ngx.log
local ngx_WARN   = ngx.WARN
local ngx_now    = ngx.now
local io_open    = io.open
local type       = type
local ipairs     = ipairs
local str_find   = string.find
local str_format = string.format

local TEXT_FIELDS = { "model", "user" }   -- body fields the gateway reads as text

local _M = {}

-- Decision ids: unique per gateway (worker pid and start time, then a counter), chosen here so that
-- Nginx can end a decision it will not use without having heard the answer.
local id_prefix, id_count = nil, 0

local function next_id()
    if not id_prefix then
        id_prefix = str_format("%x.%x.", ngx.worker.pid(), ngx.now() * 1000)
    end
    id_count = id_count + 1
    return id_prefix .. id_count
end

local function read_body()
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if body then
        return body
    end
    -- Larger than client_body_buffer_size: Nginx spooled it to a temp file.
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "failed to open body file: " .. err
    end
    body = f:read("*a")
    f:close()
    return body
end

-- What crosses to the sidecar as text must be UTF-8; returns an error message and its param, or nil.
local function invalid_text(body, session)
    if type(session) == "string" and not utf8.valid(session) then
        return "The " .. conf.session_header .. " header is not valid UTF-8 text."
    end
    for _, field in ipairs(TEXT_FIELDS) do
        local value = body[field]
        if type(value) == "string" and not utf8.valid(value) then
            return "`" .. field .. "` is not valid UTF-8 text.", field
        end
    end
end

-- Why a decision call failed, as the fail-open counter names it.
local function failure_reason(err)
    if str_find(err, "timeout", 1, true) then
        return "timeout"
    end
    if str_find(err, "failed to connect", 1, true) then
        return "refused"
    end
    return "error"
end

function _M.run()
    local raw, err = read_body()
    if not raw or raw == "" then
        return errors.send(400, err or "The request body is empty; send a JSON object.")
    end
    local body = cjson.decode(raw)
    if type(body) ~= "table" then
        return errors.send(400, "The request body is not valid JSON.")
    end
    local session = ngx.req.get_headers()[conf.session_header]
    local message, param = invalid_text(body, session)
    if message then
        return errors.send(400, message, nil, param)
    end
    local f = features.extract(body, session)
    local ctx = ngx.ctx
    local id = next_id()
    -- Reading and decoding a large body leaves Nginx's cached clock behind; the decision's budget
    -- must start now, not when the request arrived.
    ngx.update_time()
    local started = ngx_now()
    local reply, decision, code
    reply, err = sidecar.decide(id, f)
    ngx.update_time()
    stats.observe_decision(ngx_now() - started)
    if reply then
        decision, err, code = protocol.decision(reply)
    end
    if code == "unknown_model" then
        return errors.send(404, err, nil, "model")
    end
    if decision and #decision.addrs > 0 then
        ctx.kv_id = id
        ctx.kv_ids, ctx.kv_addrs, ctx.kv_route = decision.ids, decision.addrs, decision.route
    else
        if not code and reply == nil then
            -- The sidecar may have made (and counted) the decision we did not wait for.
            reports.push(protocol.drop(id))
        end
        local reason = decision and "error" or failure_reason(err or "")
        stats.incr("m:failopen:", reason)
        ngx_log(ngx_WARN, "kvgate: sidecar decision failed (", err or "no eligible backend",
                "); routing on the local ring")
        local ids, addrs = failopen.order(f.key)
        if #addrs == 0 then
            return errors.send(503, "No healthy backend is available.")
        end
        ctx.kv_ids, ctx.kv_addrs, ctx.kv_route = ids, addrs, "fail-open"
    end
    ctx.kv_tries = 0
    reports.stash(ctx)
end

return _M
