-- The wire protocol to the sidecar, Lua side: the one Lua home of its keys. Twin of
-- sidecar/kvgate/protocol.py (which documents every message); tests/golden/protocol.json holds
-- messages both must build and read alike. Every message carries the protocol version pv: a reply in
-- another version is refused with a loud log line, and the request routes fail-open.

local ngx        = ngx
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_now    = ngx.now
local type       = type
local pairs      = pairs
local tostring   = tostring
local math_floor = math.floor

local VERSION = 4
local MISMATCH_LOG_EVERY_S = 10   -- loud, but not once per request

local _M = { VERSION = VERSION }

local last_mismatch_log = 0

-- Messages to the sidecar ------------------------------------------------------------------------

-- id: this gateway's name for the decision; f: the table features.extract returns. No hashes: no h
-- (cjson would write an empty table as {}). tb: the request's body, when the sidecar tokenizes it.
function _M.decide(id, f)
    local hashes = f.hashes
    if #hashes == 0 then
        hashes = nil
    end
    return { pv = VERSION, op = "decide", i = id,
             f = { m = f.model, k = f.key, ks = f.key_source, h = hashes, b = f.prompt_bytes,
                   ck = f.client_key, ca = f.client_addr, mt = f.max_tokens, n = f.completions,
                   pr = f.priority, tn = f.tenant, tb = f.body } }
end

function _M.report(outcomes)
    return { pv = VERSION, op = "report", o = outcomes }
end

-- fp: the fingerprint of the settings this Nginx was rendered with (conf.fingerprint).
function _M.peers(fp)
    return { pv = VERSION, op = "peers", fp = fp ~= "" and fp or nil }
end

function _M.models()
    return { pv = VERSION, op = "models" }
end

function _M.keys()
    return { pv = VERSION, op = "keys" }
end

-- Outcomes (see protocol.py): every decision ends in one "end" or one "drop".

-- The response's first body byte went out: the backend finished this request's prefill. rid: the
-- id of a /v1/responses response, which that backend now stores.
function _M.first(id, backend, rid)
    return { k = "first", i = id, b = backend, r = rid }
end

-- The request ended. id is nil for a fail-open request; ttft (streams) and duration may be nil; cut is
-- true when the backend closed the response before its end; pt and ct are the response's usage;
-- rid the id of a /v1/responses response (the backend keeps it: later turns must come back); who,
-- a fail-open request's tenant, which no decision counted: { ck = key name, ca = client address,
-- tn = the tenant header's value }, or nil.
function _M.ended(id, backend, status, sent, ttft, duration, cut, pt, ct, rid, kt, who)
    local out = { k = "end", i = id, b = backend, s = status, x = sent, t = ttft, d = duration,
                  c = cut or nil, pt = pt, ct = ct, r = rid, kt = kt }
    if who then
        out.ck, out.ca, out.tn = who.ck, who.ca, who.tn
    end
    return out
end

-- An earlier candidate failed before the one that answered.
function _M.tried(backend, status)
    return { k = "try", b = backend, s = status }
end

-- The decision was not used (late answer, fail-open, client gone before dispatch).
function _M.drop(id)
    return { k = "drop", i = id }
end

-- Replies from the sidecar -----------------------------------------------------------------------

-- The reply if it speaks our version, else nil and an error (logged at most every 10 s).
function _M.check(reply)
    if type(reply) ~= "table" then
        return nil, "reply is not a JSON object"
    end
    if reply.pv ~= VERSION then
        local err = "protocol version mismatch: this gateway speaks " .. VERSION
                    .. ", the sidecar " .. tostring(reply.pv)
        local now = ngx_now()
        if now - last_mismatch_log >= MISMATCH_LOG_EVERY_S then
            last_mismatch_log = now
            ngx_log(ngx_ERR, "kvgate: ", err, "; routing fail-open until both come from the same release")
        end
        return nil, err
    end
    return reply
end

-- The request waits in the gateway queue: the decision follows on the same connection.
function _M.queued(reply)
    return reply.q ~= nil and reply.e == nil and reply.c == nil
end

local function pairs_of(c)
    local ids, addrs = {}, {}
    for i = 1, #c do
        local pair = c[i]
        if type(pair) ~= "table" or type(pair[1]) ~= "string" or type(pair[2]) ~= "string" then
            return nil
        end
        ids[i], addrs[i] = pair[1], pair[2]
    end
    return ids, addrs
end

-- Each candidate's first-byte timeout in ms, or nil when the reply has none (or a malformed one).
local function budgets(fb, n)
    if type(fb) ~= "table" or #fb ~= n then
        return nil
    end
    for i = 1, n do
        local ms = fb[i]
        if type(ms) ~= "number" or ms <= 0 then
            return nil
        end
    end
    return fb
end

-- A decision: { id, ids = {backend ids}, addrs = {host:port}, route, priority (to write into the
-- body, or nil), prefill_ids, prefill_addrs (disaggregated, or nil), first_byte_ms (one per
-- candidate, or nil), max_tokens (to write into the body: a token limit's headroom, or nil) }; or
-- nil, error message, error code (the sidecar's, e.g. "unknown_model"; nil for a malformed reply),
-- retry-after seconds.
function _M.decision(reply)
    if reply.e then
        return nil, tostring(reply.msg), reply.e, reply.ra
    end
    if type(reply.c) ~= "table" then
        return nil, "decision without candidates"
    end
    local ids, addrs = pairs_of(reply.c)
    if not ids then
        return nil, "malformed candidate"
    end
    local out = { id = reply.i, ids = ids, addrs = addrs, route = reply.r,
                  first_byte_ms = budgets(reply.fb, #ids) }
    local mt = reply.mt
    if type(mt) == "number" and mt >= 1 and mt == math_floor(mt) then
        out.max_tokens = mt
    end
    if type(reply.pr) == "number" then
        out.priority = reply.pr
    end
    if type(reply.pc) == "table" and #reply.pc > 0 then
        out.prefill_ids, out.prefill_addrs = pairs_of(reply.pc)
        if not out.prefill_ids then
            return nil, "malformed prefill candidate"
        end
    end
    return out
end

-- The fail-open peer list: version, { {id =, addr =}, ... }, backends the sidecar knows (eligible
-- or not); or nil, error.
function _M.peer_list(reply)
    if type(reply.peers) ~= "table" or type(reply.v) ~= "number" then
        return nil, "malformed peers reply"
    end
    local known = reply.n
    if type(known) ~= "number" then
        known = #reply.peers
    end
    return reply.v, reply.peers, known
end

-- The API keys: version, {sha256 hex = key name}, {key name = priority} (the classes not 0),
-- {key name = {requests, tokens}} (the limited keys' rates a minute); or nil, error.
function _M.key_list(reply)
    if type(reply.keys) ~= "table" or type(reply.v) ~= "number" then
        return nil, "malformed keys reply"
    end
    local classes, rates = {}, {}
    if type(reply.kp) == "table" then
        for name, p in pairs(reply.kp) do
            if type(name) == "string" and type(p) == "number" then
                classes[name] = p
            end
        end
    end
    if type(reply.kl) == "table" then
        for name, r in pairs(reply.kl) do
            if type(name) == "string" and type(r) == "table" and type(r[1]) == "number"
                    and type(r[2]) == "number" then
                rates[name] = { r[1], r[2] }
            end
        end
    end
    return reply.v, reply.keys, classes, rates
end

-- The model cards of /v1/models, or nil, error.
function _M.model_list(reply)
    if type(reply.data) ~= "table" then
        return nil, "malformed models reply"
    end
    return reply.data
end

return _M
