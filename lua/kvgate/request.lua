-- One routed request's state: built once in access (request.new), then read and advanced by the
-- balancer, the filters and the log phase. Its fields are declared here and nowhere else; writing any
-- other field is an error, so a misspelt name fails in the tests instead of reading as nil.
--
-- It lives in ngx.ctx.kvgate and, because an internal redirect (error_page) drops ngx.ctx, in a
-- per-worker stash under $kvgate_ref, where the error location's log phase finds it again (finish).

local error    = error
local rawset   = rawset
local tostring = tostring
local setmetatable = setmetatable

local _M = {}

local FIELDS = {
    -- set in access
    id          = "the decision's id (nil when the gateway routed on its own: fail-open)",
    kind        = "the route's $kvgate_kind: json, responses, response_id or multipart",
    ids         = "candidate backend ids, in order",
    addrs       = "their host:port, in the same order",
    route       = "how they were chosen (the decision's route, or fail-open)",
    read_s      = "per candidate: how long a try may wait for the next byte, in seconds",
    strip_usage = "the gateway asked for the stream's usage event: the client does not get it",
    who         = "fail-open: its tenant for its end to report (no decision counted it), protocol.ended",
    -- the balancer
    tries       = "tries so far (Nginx calls the balancer once per try)",
    picks       = "per try: the index of the candidate it went to",
    -- the filters
    stream      = "the response is an event stream",
    first       = "seconds from the request's start to the first body byte",
    eof         = "the response has ended (or was cut)",
    cut         = "the backend closed the response before it finished",
    rid         = "the Responses API id the backend answered with (a session for the next turn)",
    tail        = "the last two chunks, where the usage is (rate limits)",
    last        = "the last chunk (keeps tail two chunks long)",
    carry       = "an event unfinished at a chunk's end, held for the next chunk",
}

local Request = {}
Request.__index = Request
Request.__newindex = function(t, k, v)
    if not FIELDS[k] then
        error("kvgate: a request has no field " .. tostring(k), 2)
    end
    rawset(t, k, v)
end

-- Requests kept for the log phase across an internal redirect, by $kvgate_ref.
local stash, stash_seq = {}, 0

-- The request's state, from candidates access chose; kept in ngx.ctx and the stash.
function _M.new(id, kind, ids, addrs, route, read_s, strip_usage)
    local req = setmetatable({}, Request)
    req.id, req.kind, req.ids, req.addrs, req.route = id, kind, ids, addrs, route
    req.read_s, req.strip_usage, req.tries = read_s, strip_usage or false, 0
    ngx.ctx.kvgate = req
    stash_seq = stash_seq + 1
    local ref = tostring(stash_seq)
    stash[ref] = req
    ngx.var.kvgate_ref = ref
    return req
end

-- The current request's state, or nil when access routed nothing (an error, an API location).
function _M.current()
    return ngx.ctx.kvgate
end

-- The state, in the log phase: from ngx.ctx, or from the stash after an internal redirect. Either
-- way it leaves the stash: the request is over.
function _M.finish()
    local ref = ngx.var.kvgate_ref
    local kept = ref and ref ~= "" and stash[ref] or nil
    if kept then
        stash[ref] = nil
    end
    return ngx.ctx.kvgate or kept
end

-- The backend id of the try now answering.
function _M.backend(req)
    return req.ids[req.picks[req.tries]]
end

return _M
