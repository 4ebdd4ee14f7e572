-- kvgate's Nginx hook. Decide in access (the only phase here that may do I/O), apply in balancer,
-- label in header_filter, report in log. See docs/architecture.md.

local cjson      = require "cjson.safe"
local balancer   = require "ngx.balancer"
local features   = require "kvgate.features"
local sidecar    = require "kvgate.sidecar"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_WARN   = ngx.WARN
local ngx_now    = ngx.now
local ngx_crc32  = ngx.crc32_long
local tonumber   = tonumber
local tostring   = tostring
local type       = type
local str_match  = string.match
local str_gmatch = string.gmatch
local tbl_sort   = table.sort

local _M = { _VERSION = "0.1.0" }

local PEERS_REFRESH_S = 1     -- how often one worker refreshes the fail-open peer list
local REPORT_EVERY_S  = 0.1   -- outcome reports are flushed in batches this often
local REPORT_MAX      = 10000 -- bound of one worker's unsent outcomes
local TEXT_FIELDS     = { "session", "model", "user" }

local conf = {
    session_header = "X-Session-ID",
    route_headers = true,   -- X-Kvgate-Backend / X-Kvgate-Route on responses
    max_tries = 3,
    dict = "kvgate",
}

local pending, npending, dropped = {}, 0, 0
local peers_cache = { version = -1, list = {} }

local function json_error(status, message, typ, param)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode({ error = { message = message, type = typ, param = param or cjson.null,
                                     code = status } }))
    return ngx.exit(status)
end
_M.json_error = json_error

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
    local f, err = io.open(path, "rb")
    if not f then
        return nil, "failed to open body file: " .. err
    end
    body = f:read("*a")
    f:close()
    return body
end

local function split_addr(addr)
    local host, port = str_match(addr, "^(.+):(%d+)$")
    return host, tonumber(port)
end

-- Fail-open peers: the sidecar's last healthy list, kept in a shared dict by a background timer and
-- decoded once per worker per version.
local function current_peers()
    local dict = ngx.shared[conf.dict]
    local version = dict:get("peers:version")
    if version == nil then
        return peers_cache.list
    end
    if version ~= peers_cache.version then
        local decoded = cjson.decode(dict:get("peers:list") or "")
        if type(decoded) == "table" then
            peers_cache.list = decoded
            peers_cache.version = version
        end
    end
    return peers_cache.list
end

-- Rendezvous (highest-random-weight) hashing over the last known peers: every worker and replica
-- orders the same peers the same way for a key, and losing one peer moves only its keys.
local function fail_open_order(key)
    local peers = current_peers()
    local scored = {}
    for i, p in ipairs(peers) do
        scored[i] = { p = p, s = ngx_crc32((key or tostring(ngx_now())) .. "|" .. p.id) }
    end
    tbl_sort(scored, function(a, b) return a.s > b.s end)
    local ids, addrs = {}, {}
    for i = 1, math.min(#scored, conf.max_tries) do
        ids[i] = scored[i].p.id
        addrs[i] = scored[i].p.addr
    end
    return ids, addrs
end

function _M.configure(opts)
    for k, v in pairs(opts) do
        if conf[k] ~= nil then
            conf[k] = v
        end
    end
    sidecar.configure(opts)
end

local function refresh_peers(premature)
    if premature then
        return
    end
    local dict = ngx.shared[conf.dict]
    local ok = dict:add("peers:lock", true, PEERS_REFRESH_S * 0.9)
    if not ok then
        return -- another worker refreshes this round
    end
    local reply, err = sidecar.peers()
    if not reply or type(reply.peers) ~= "table" then
        ngx_log(ngx_WARN, "kvgate: peer refresh failed, keeping the last list: ", err or "bad reply")
        return
    end
    if dict:get("peers:version") ~= reply.v or dict:get("peers:list") == nil then
        local okset, serr = dict:set("peers:list", cjson.encode(reply.peers))
        if not okset then
            ngx_log(ngx_ERR, "kvgate: failed to store peers: ", serr)
            return
        end
        okset, serr = dict:set("peers:version", reply.v)
        if not okset then
            ngx_log(ngx_ERR, "kvgate: failed to store peers version: ", serr)
        end
    end
end

local function flush_reports(premature)
    if npending == 0 then
        return
    end
    local batch = pending
    pending, npending = {}, 0
    local ok, err = sidecar.report(batch)
    if not ok and not premature then
        ngx_log(ngx_WARN, "kvgate: dropped ", #batch, " outcome report(s): ", err)
    end
end

function _M.init_worker()
    local ok, err = ngx.timer.every(PEERS_REFRESH_S, refresh_peers)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the peer refresh timer: ", err)
    end
    ok, err = ngx.timer.every(REPORT_EVERY_S, flush_reports)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the report timer: ", err)
    end
    ngx.timer.at(0, refresh_peers)
end

function _M.access()
    local raw, err = read_body()
    if not raw or raw == "" then
        return json_error(400, err or "The request body is empty; send a JSON object.",
                          "invalid_request_error")
    end
    local body = cjson.decode(raw)
    if type(body) ~= "table" then
        return json_error(400, "The request body is not valid JSON.", "invalid_request_error")
    end
    local session = ngx.req.get_headers()[conf.session_header]
    -- What the gateway reads from the client crosses to the sidecar as text: it must be UTF-8.
    for _, field in ipairs(TEXT_FIELDS) do
        local value = field == "session" and session or body[field]
        if type(value) == "string" and not features.valid_utf8(value) then
            local what = field == "session" and ("The " .. conf.session_header .. " header")
                         or ("`" .. field .. "`")
            return json_error(400, what .. " is not valid UTF-8 text.", "invalid_request_error",
                              field ~= "session" and field or nil)
        end
    end
    local f = features.extract(body, session)
    local ctx = ngx.ctx
    local reply
    reply, err = sidecar.decide(f)
    if reply and reply.e == "unknown_model" then
        return json_error(404, reply.msg, "NotFoundError", "model")
    end
    local ids, addrs, reason
    if reply and not reply.e and type(reply.a) == "table" and #reply.a > 0 then
        ids, addrs, reason = reply.c, reply.a, reply.r
        ctx.kv_id = reply.i
    else
        if reply and reply.e then
            err = reply.e .. ": " .. tostring(reply.msg)
        elseif reply then
            err = "no eligible backend"
        end
        ids, addrs = fail_open_order(f.k)
        reason = "fail-open"
        ngx_log(ngx_WARN, "kvgate: sidecar decision failed (", err, "); routing on the local ring")
        if #addrs == 0 then
            return json_error(503, "No healthy backend is available.", "ServiceUnavailableError")
        end
    end
    ctx.kv_ids, ctx.kv_addrs, ctx.kv_reason, ctx.kv_tries = ids, addrs, reason, 0
end

function _M.balancer()
    local ctx = ngx.ctx
    local addrs = ctx.kv_addrs
    local i = ctx.kv_tries + 1
    if i > #addrs then
        -- Every candidate failed: Nginx answers 502 (rendered as JSON by error_page).
        return ngx.exit(502)
    end
    ctx.kv_tries = i
    if i == 1 and #addrs > 1 then
        local ok, err = balancer.set_more_tries(#addrs - 1)
        if not ok then
            ngx_log(ngx_ERR, "kvgate: failed to set retries: ", err)
        end
    end
    local host, port = split_addr(addrs[i])
    local ok, err = balancer.set_current_peer(host, port)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to set peer ", addrs[i], ": ", err)
        return ngx.exit(502)
    end
end

local function push_report(item)
    if npending >= REPORT_MAX then
        dropped = dropped + 1
        return
    end
    npending = npending + 1
    pending[npending] = item
end

function _M.header_filter()
    local ctx = ngx.ctx
    if not ctx.kv_ids or not ctx.kv_tries or ctx.kv_tries == 0 then
        return
    end
    if conf.route_headers then
        ngx.header["X-Kvgate-Backend"] = ctx.kv_ids[ctx.kv_tries]
        ngx.header["X-Kvgate-Route"] = ctx.kv_reason
    end
    -- Streamed responses start when the first token exists: the backend's prefill for this request
    -- is done, which frees its share of the sidecar's prefill-queue estimate right away.
    if ctx.kv_id then
        push_report({ i = ctx.kv_id, b = ctx.kv_ids[ctx.kv_tries], f = true })
    end
end

local function last_number(list)
    local last
    if list then
        for v in str_gmatch(list, "[^,%s]+") do
            last = v
        end
    end
    return tonumber(last)
end

function _M.log()
    local ctx = ngx.ctx
    local ids, tries = ctx.kv_ids, ctx.kv_tries
    if not ids or not tries or tries == 0 then
        return
    end
    -- Earlier candidates failed before this one answered: report them as connection failures.
    local statuses = {}
    for v in str_gmatch(ngx_var.upstream_status or "", "[^,%s]+") do
        statuses[#statuses + 1] = tonumber(v) or 0
    end
    for t = 1, tries - 1 do
        push_report({ i = 0, b = ids[t], s = statuses[t] or 0, x = false })
    end
    push_report({
        i = ctx.kv_id or 0,
        b = ids[tries],
        s = statuses[tries] or tonumber(ngx_var.status) or 0,
        t = last_number(ngx_var.upstream_header_time),
        x = (tonumber(ngx_var.body_bytes_sent) or 0) > 0,
    })
end

function _M.models()
    local dict = ngx.shared[conf.dict]
    local reply = sidecar.models()
    if reply and type(reply.data) == "table" then
        local encoded = cjson.encode(reply)
        dict:set("models:last", encoded)
        ngx.header["Content-Type"] = "application/json"
        return ngx.say(encoded)
    end
    local last = dict:get("models:last")
    if last then
        ngx.header["Content-Type"] = "application/json"
        return ngx.say(last)
    end
    return json_error(503, "The model list is unavailable (routing sidecar unreachable).",
                      "ServiceUnavailableError")
end

function _M.health()
    local peers = current_peers()
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode({ status = "ok", fail_open_peers = #peers,
                           peers_version = peers_cache.version, dropped_reports = dropped }))
end

return _M
