-- The access phase, the only phase here that may do I/O: read the body, check what the gateway reads
-- of it, compute the request's features, ask the sidecar for a decision (or fall open), and leave the
-- candidates in ngx.ctx for the balancer.

local agreement = require "kvgate.agreement"
local auth     = require "kvgate.auth"
local cjson    = require "cjson.safe"
local checks   = require "kvgate.checks"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local disagg   = require "kvgate.disagg"
local failopen = require "kvgate.failopen"
local features = require "kvgate.features"
local jsontext = require "kvgate.jsontext"
local outbox   = require "kvgate.outbox"
local priority = require "kvgate.priority"
local protocol = require "kvgate.protocol"
local request  = require "kvgate.request"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_now    = ngx.now
local type       = type
local tostring   = tostring
local math_max   = math.max
local math_min   = math.min
local str_find   = string.find
local str_match  = string.match
local str_format = string.format

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

-- How long each try may wait for the response's next byte (see conf.lua), in seconds, one per
-- candidate: the sidecar's first-byte budget for that backend (never above Nginx's own ceiling), else
-- the ceiling; a stream at least first_byte_stream_min_ms; a JSON response comes whole, so it also
-- waits for the tokens it asked for (with no token count, the longest wait).
local function read_timeouts(stream, tokens, n, budgets)
    local ceiling = conf.first_byte_timeout_ms
    local out = {}
    for i = 1, n do
        local ms = budgets and math_min(budgets[i], ceiling) or ceiling
        if stream then
            ms = math_max(ms, math_min(conf.first_byte_stream_min_ms, ceiling))
        elseif tokens then
            ms = math_min(conf.max_read_timeout_ms, ms + tokens * conf.token_timeout_ms)
        else
            ms = conf.max_read_timeout_ms
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

-- With usage read (conf.usage): what the token count needs from the backend. A request the sidecar gave a
-- max_tokens (it had none, and a token limit applies) gets it; a stream asks for its usage (vLLM sends
-- it last), which the body filter strips again when the client did not ask for it. Returns whether
-- it asked.
local function usage_fields(body, decision, kind, generates, added)
    if decision.max_tokens then
        added[#added + 1] = { kind == "responses" and "max_output_tokens" or "max_tokens",
                              str_format("%d", decision.max_tokens) }
    end
    local options = body.stream_options
    if generates and body.stream == true and (options == nil or options == cjson.null
                                               or type(options) == "table" and options.include_usage ~= true) then
        options = type(options) == "table" and options or {}
        options.include_usage = true
        added[#added + 1] = { "stream_options", cjson.encode(options) }
        return true
    end
    return false
end

-- Ends what no backend should see (each check ends the request with its error).
local function refuse_early()
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
    if not str_find(ngx_var.uri, "^/[%w/%._%-]*$") then
        return errors.send(404, "Unknown route.")   -- what $uri may hold once proxied as the path
    end
end

-- The request's features for the sidecar (see features.lua), or an end with a 400.
local function read_request(kind, key_name)
    local body, err, raw = checks.json_body(kind)
    if not body then
        return errors.send(400, err)
    end
    local headers = ngx.req.get_headers()
    local session = headers[conf.session_header]
    local message, param = checks.invalid(body, session)
    if message then
        return errors.send(400, message, nil, param)
    end
    local tenant, bad = checks.tenant(headers)
    if bad then
        return errors.send(400, bad)
    end
    local f = features.extract(body, session)
    if kind == "response_id" then
        local rid = str_match(ngx_var.uri, "^/v1/responses/([%w_%-]+)")
        if rid then
            f.key, f.key_source = features.session_key("r", rid), "response"
        end
    end
    f.client_key, f.tenant = key_name, tenant
    f.client_addr = conf.limits and ngx_var.remote_addr or nil
    f.max_tokens = checks.max_tokens(body)
    f.completions = checks.completions(body)
    f.priority = checks.priority(body)
    f.body = checks.tokenizable(body, raw)
    return body, raw, f
end

-- The sidecar's decision, or nil, why it failed, the fail-open counter's reason and whether the
-- sidecar answered at all; the sidecar's refusals end the request here with their status.
local function decide(id, f)
    -- Reading and decoding a large body leaves Nginx's cached clock behind; the decision's budget
    -- must start now, not when the request arrived.
    ngx.update_time()
    local started = ngx_now()
    local reply, err = sidecar.decide(id, f)
    ngx.update_time()
    stats.observe_decision(ngx_now() - started)
    if not reply then
        return nil, err, failure_reason(err or ""), false
    end
    local decision, message, code, retry_after = protocol.decision(reply)
    if code == "unknown_model" then
        return errors.send(404, message, nil, "model")
    end
    if code == "rate_limited" then
        ngx.header["Retry-After"] = tostring(retry_after or 1)
        return errors.send(429, message, nil, nil, "rate_limit_exceeded")
    end
    if code == "queue_full" or code == "queue_timeout" or code == "slo_shed" then
        ngx.header["Retry-After"] = tostring(retry_after or 1)
        return errors.send(429, message, "RateLimitError", nil, code)
    end
    if decision and #decision.addrs > 0 then
        return decision
    end
    return nil, message, decision and "error" or failure_reason(message or ""), true
end

-- The body the backend gets: the client's, with the fields the decision adds spliced in (jsontext:
-- not re-encoded), after the prefill leg of a disaggregated request. Fail-open builds its own
-- decision (no id, no prefill leg). Returns the route as it turned out and whether the gateway asked
-- for the stream's usage.
local function backend_body(body, raw, decision, kind)
    local added = {}
    local class = priority.field(body, raw, decision.priority or 0)
    if class then
        added[#added + 1] = class
    end
    local route = decision.route
    local generates = ngx_var.uri == "/v1/chat/completions" or ngx_var.uri == "/v1/completions"
    if decision.prefill_addrs and not generates then
        route = route .. "/colocated"   -- only generation has a prefill leg to split off
    elseif decision.prefill_addrs then
        -- Disaggregated: the prefill leg runs now; the decoder gets what it handed over, or, when no
        -- prefill backend could, the whole request (co-located).
        local params = disagg.prefill(raw, body, decision.prefill_ids, decision.prefill_addrs)
        if params then
            added[#added + 1] = { "kv_transfer_params", params }
        else
            route = route .. "/colocated"
        end
    end
    local strip_usage = conf.usage and usage_fields(body, decision, kind, generates, added)
    if #added > 0 then
        ngx.req.set_body_data(jsontext.with_fields(raw, added))
    end
    return route, strip_usage
end

-- kind (the route's $kvgate_kind): "json" (a JSON body, or none for GET/DELETE), "responses" (the
-- same, and the response's id becomes a session), "response_id" (the id in the path is the session),
-- "multipart" (the body is not read).
function _M.run()
    refuse_early()
    local kind = ngx_var.kvgate_kind
    local key_name = conf.auth and auth.check() or nil
    local body, raw, f = read_request(kind, key_name)
    local id = next_id()
    -- A client that goes away while this handler waits (for the sidecar's decision, its place in the
    -- gateway queue, a prefill leg) ends the request (lua_check_client_abort): the decision the
    -- sidecar made or is making ends as dropped, and a waiting request leaves the queue at once.
    ngx.on_abort(function()
        outbox.push(protocol.drop(id))
        outbox.flush_now()
        return ngx.exit(499)
    end)
    local decision, err, reason, answered = decide(id, f)
    local decided = decision ~= nil
    if not decided then
        local ids, addrs = failopen.route(id, f, err, reason, answered)
        decision = { ids = ids, addrs = addrs, route = "fail-open", priority = priority.fail_open(f, key_name) }
    end
    local route, strip_usage = backend_body(body, raw, decision, kind)
    local read_s = read_timeouts(body.stream == true, f.max_tokens, #decision.addrs, decision.first_byte_ms)
    local req = request.new(decided and id or nil, kind, decision.ids, decision.addrs, route, read_s, strip_usage)
    if not decided then
        -- No decision counted it: its end carries its tenant, counted then by its usage.
        req.who = { ck = key_name, ca = f.client_addr, tn = f.tenant }
    end
end

return _M
