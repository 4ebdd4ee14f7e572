-- The access phase, the only phase here that may do I/O: read the body, check what the gateway reads
-- of it, compute the request's features, ask the sidecar for a decision (or fall open), and leave the
-- candidates in ngx.ctx for the balancer.

local agreement = require "kvgate.agreement"
local auth     = require "kvgate.auth"
local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local disagg   = require "kvgate.disagg"
local failopen = require "kvgate.failopen"
local features = require "kvgate.features"
local jsontext = require "kvgate.jsontext"
local protocol = require "kvgate.protocol"
local reports  = require "kvgate.reports"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"
local utf8     = require "kvgate.utf8"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_log    = ngx.log
local ngx_WARN   = ngx.WARN
local ngx_now    = ngx.now
local io_open    = io.open
local type       = type
local tostring   = tostring
local pairs      = pairs
local ipairs     = ipairs
local math_floor = math.floor
local math_max   = math.max
local math_min   = math.min
local str_find   = string.find
local str_match  = string.match
local str_format = string.format

-- What the gateway accepts: a JSON object (no NaN, Infinity or hex numbers, at most MAX_DEPTH deep)
-- whose fields the gateway reads have the right type and size. Everything else a backend checks.
local MAX_DEPTH     = 64
local MAX_TEXT      = 512    -- bytes of the session header or `user`
local MAX_MODEL     = 256    -- bytes of `model`
local MAX_TOKENS    = 2147483647
local MIN_PRIORITY  = -2147483648
local MAX_PRIORITY  = 2147483647
local TEXT_FIELDS   = { model = MAX_MODEL, user = MAX_TEXT }
local TOKEN_FIELDS  = { "max_tokens", "max_completion_tokens" }

local json = cjson.new()
json.decode_invalid_numbers(false)
json.decode_max_depth(MAX_DEPTH)

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

-- The fields the gateway reads; returns an error message and its param, or nil. Text that crosses to
-- the sidecar must be UTF-8 and short (long keys would fill Redis).
local function invalid(body, session)
    if type(session) == "table" then
        return "Send one " .. conf.session_header .. " header, not several."
    end
    if session ~= nil then
        if #session > MAX_TEXT then
            return "The " .. conf.session_header .. " header is longer than " .. MAX_TEXT .. " bytes."
        end
        if not utf8.valid(session) then
            return "The " .. conf.session_header .. " header is not valid UTF-8 text."
        end
    end
    for field, max in pairs(TEXT_FIELDS) do
        local value = body[field]
        if value ~= nil then
            if type(value) ~= "string" then
                return "`" .. field .. "` must be a string.", field
            end
            if #value > max then
                return "`" .. field .. "` is longer than " .. max .. " bytes.", field
            end
            if not utf8.valid(value) then
                return "`" .. field .. "` is not valid UTF-8 text.", field
            end
        end
    end
    for _, field in ipairs(TOKEN_FIELDS) do
        local value = body[field]
        if value ~= nil and value ~= cjson.null and (type(value) ~= "number" or value ~= math_floor(value)
                                                     or value < 0 or value > MAX_TOKENS) then
            return "`" .. field .. "` must be a whole number of tokens.", field
        end
    end
    local stream = body.stream
    if stream ~= nil and stream ~= cjson.null and type(stream) ~= "boolean" then
        return "`stream` must be true or false.", "stream"
    end
    local priority = body.priority
    if priority ~= nil and priority ~= cjson.null and (type(priority) ~= "number"
                                                     or priority ~= math_floor(priority)
                                                     or priority < MIN_PRIORITY or priority > MAX_PRIORITY) then
        return "`priority` must be a whole number.", "priority"
    end
end

-- The priority the client asked for: the body's (vLLM's field), else an X-Priority header.
local function client_priority(body)
    local p = body.priority
    if type(p) == "number" then
        return p
    end
    p = tonumber(ngx_var.http_x_priority)
    if p and p == math_floor(p) and p >= MIN_PRIORITY and p <= MAX_PRIORITY then
        return p
    end
    return nil
end

-- How long each try may wait for the response's next byte (see conf.lua), in seconds, one per
-- candidate: the sidecar's first-byte budget for that backend (never above Nginx's own ceiling), else
-- the ceiling; a stream at least first_byte_stream_min_ms; a JSON response comes whole, so it also
-- waits for the tokens it asked for.
local function read_timeouts(body, n, budgets)
    local ceiling = conf.first_byte_timeout_ms
    local stream = body.stream == true
    local tokens = body.max_completion_tokens
    if type(tokens) ~= "number" then
        tokens = body.max_tokens
    end
    local out = {}
    for i = 1, n do
        local ms = budgets and math_min(budgets[i], ceiling) or ceiling
        if stream then
            ms = math_max(ms, math_min(conf.first_byte_stream_min_ms, ceiling))
        else
            -- No token count: the longest wait.
            ms = type(tokens) == "number" and math_min(conf.max_read_timeout_ms, ms + tokens * conf.token_timeout_ms)
                 or conf.max_read_timeout_ms
        end
        out[i] = ms / 1000
    end
    return out
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

-- The request's JSON body, or nil and an error message. Requests without one (a GET, a DELETE, a
-- multipart upload) are routed on their headers alone: an empty table.
local function json_body(kind)
    local method = ngx.req.get_method()
    if kind == "multipart" or method == "GET" or method == "DELETE" or method == "HEAD" then
        return {}
    end
    local raw, err = read_body()
    if not raw or raw == "" then
        return nil, err or "The request body is empty; send a JSON object."
    end
    if not str_find(raw, "^%s*{") then
        return nil, "The request body must be a JSON object."
    end
    local body
    body, err = json.decode(raw)
    if not body and err and str_find(err, "unicode escape", 1, true) then
        body, err = json.decode(jsontext.raw_surrogates(raw))   -- lone surrogates, as vLLM takes them
    end
    if type(body) ~= "table" then
        return nil, "The request body is not valid JSON: " .. (err or "not an object") .. "."
    end
    return body, nil, raw
end

-- With rate limits on: what the token count needs from the backend. A request the sidecar gave a
-- max_tokens (it had none, and a token limit applies) gets it; a stream asks for its usage (vLLM sends
-- it last), which the body filter strips again when the client did not ask for it.
local function usage_fields(ctx, body, decision, kind, generates, added)
    if decision and decision.max_tokens then
        added[#added + 1] = { kind == "responses" and "max_output_tokens" or "max_tokens",
                              str_format("%d", decision.max_tokens) }
    end
    local options = body.stream_options
    if generates and body.stream == true and (options == nil or options == cjson.null
                                               or type(options) == "table" and options.include_usage ~= true) then
        options = type(options) == "table" and options or {}
        options.include_usage = true
        added[#added + 1] = { "stream_options", cjson.encode(options) }
        ctx.kv_strip_usage = true
    end
end

-- kind (the route's $kvgate_kind): "json" (a JSON body, or none for GET/DELETE), "responses" (the
-- same, and the response's id becomes a session), "response_id" (the id in the path is the session),
-- "multipart" (the body is not read).
function _M.run()
    if conf.edge_access ~= "" then
        require(conf.edge_access).access()   -- the edge's own checks first; it may end the request
    end
    if agreement.refuses() then
        return errors.send(503, "The gateway is misconfigured: its Nginx and its routing sidecar run "
                           .. "different API key or rate limit settings. Requests are refused until "
                           .. "they agree.")
    end
    if not ngx_var.http_host then
        return errors.send(400, "The request has no Host header.")
    end
    local kind = ngx_var.kvgate_kind
    local uri = ngx_var.uri
    if not str_find(uri, "^/[%w/%._%-]*$") then
        return errors.send(404, "Unknown route.")   -- what $uri may hold once proxied as the path
    end
    local key_name = conf.auth and auth.check() or nil
    local body, err, raw = json_body(kind)
    if not body then
        return errors.send(400, err)
    end
    local session = ngx.req.get_headers()[conf.session_header]
    local message, param = invalid(body, session)
    if message then
        return errors.send(400, message, nil, param)
    end
    local f = features.extract(body, session)
    if kind == "response_id" then
        local rid = str_match(uri, "^/v1/responses/([%w_%-]+)")
        if rid then
            f.key, f.key_source = features.session_key("r", rid), "response"
        end
    end
    f.client_key = key_name
    f.client_addr = conf.limits and ngx_var.remote_addr or nil
    local mt = body.max_completion_tokens
    if type(mt) ~= "number" then
        mt = body.max_tokens
    end
    f.max_tokens = type(mt) == "number" and mt or nil
    f.priority = client_priority(body)
    local ctx = ngx.ctx
    local id = next_id()
    -- A client that goes away while this handler waits (for the sidecar's decision, its place in the
    -- gateway queue, a prefill leg) ends the request (lua_check_client_abort): the decision the
    -- sidecar made or is making ends as dropped, and a waiting request leaves the queue at once.
    ngx.on_abort(function()
        reports.push(protocol.drop(id))
        reports.flush_now()
        return ngx.exit(499)
    end)
    -- Reading and decoding a large body leaves Nginx's cached clock behind; the decision's budget
    -- must start now, not when the request arrived.
    ngx.update_time()
    local started = ngx_now()
    local reply, decision, code, retry_after
    reply, err = sidecar.decide(id, f)
    ngx.update_time()
    stats.observe_decision(ngx_now() - started)
    if reply then
        decision, err, code, retry_after = protocol.decision(reply)
    end
    if code == "unknown_model" then
        return errors.send(404, err, nil, "model")
    end
    if code == "rate_limited" then
        ngx.header["Retry-After"] = tostring(retry_after or 1)
        return errors.send(429, err, nil, nil, "rate_limit_exceeded")
    end
    if code == "queue_full" or code == "queue_timeout" then
        ngx.header["Retry-After"] = tostring(retry_after or 1)
        return errors.send(429, err, "RateLimitError", nil, code)
    end
    local added = {}   -- top-level fields the backend's body gains (jsontext: spliced, not re-encoded)
    if decision and decision.priority and body.priority == nil then
        -- vLLM schedules by the body's priority: the gateway's (the key's class) goes with it.
        added[#added + 1] = { "priority", str_format("%d", decision.priority) }
    end
    local route = decision and decision.route
    local generates = ngx_var.uri == "/v1/chat/completions" or ngx_var.uri == "/v1/completions"
    if decision and decision.prefill_addrs and #decision.addrs > 0 and not generates then
        route = route .. "/colocated"   -- only generation has a prefill leg to split off
    elseif decision and decision.prefill_addrs and #decision.addrs > 0 then
        -- Disaggregated: the prefill leg runs now; the decoder gets what it handed over, or, when no
        -- prefill backend could, the whole request (co-located).
        local params = disagg.prefill(raw, body, decision.prefill_ids, decision.prefill_addrs)
        if params then
            added[#added + 1] = { "kv_transfer_params", params }
        else
            route = route .. "/colocated"
        end
    end
    if conf.limits then
        usage_fields(ctx, body, decision, kind, generates, added)
    end
    if #added > 0 then
        ngx.req.set_body_data(jsontext.with_fields(raw, added))
    end
    local budgets
    if decision and #decision.addrs > 0 then
        ctx.kv_id = id
        ctx.kv_ids, ctx.kv_addrs, ctx.kv_route = decision.ids, decision.addrs, route
        budgets = decision.first_byte_ms
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
    ctx.kv_kind = kind
    ctx.kv_read_s = read_timeouts(body, #ctx.kv_addrs, budgets)
    reports.stash(ctx)
end

return _M
