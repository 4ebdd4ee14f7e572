-- The log phase: the decision's one final outcome ("end", or "drop" when no try began), and the
-- candidates that failed before the one that answered, go to the outbox; the access log gets the
-- backend, route and TTFT.

local outbox   = require "kvgate.outbox"
local protocol = require "kvgate.protocol"
local request  = require "kvgate.request"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_now    = ngx.now
local tonumber   = tonumber
local str_format = string.format
local str_match  = string.match
local str_gmatch = string.gmatch

local _M = {}

-- The response's usage, from its last chunks: chat and completions name them prompt/completion
-- tokens, the Responses API input/output; cached_tokens when vLLM reports it (the prefix-cache hit).
local function usage(tail)
    if not tail then
        return nil, nil, nil
    end
    local pt = str_match(tail, '"prompt_tokens"%s*:%s*(%d+)') or str_match(tail, '"input_tokens"%s*:%s*(%d+)')
    local ct = str_match(tail, '"completion_tokens"%s*:%s*(%d+)') or str_match(tail, '"output_tokens"%s*:%s*(%d+)')
    return tonumber(pt), tonumber(ct), tonumber(str_match(tail, '"cached_tokens"%s*:%s*(%d+)'))
end

function _M.log()
    local req = request.finish()
    if not req then
        return
    end
    local tries = req.tries
    if tries == 0 then
        -- The client went away before the request reached a backend.
        if req.id then
            outbox.push(protocol.drop(req.id))
        end
        return
    end
    -- One status per attempt; "-" where none came back (the client went away first): nil here.
    local statuses, n = {}, 0
    for v in str_gmatch(ngx_var.upstream_status or "", "[^,:%s]+") do
        n = n + 1
        statuses[n] = tonumber(v)
    end
    local ids, picks = req.ids, req.picks
    for t = 1, tries - 1 do
        outbox.push(protocol.tried(ids[picks[t]], statuses[t] or 0))
    end
    local status = statuses[tries] or tonumber(ngx_var.status) or 0
    local sent = (tonumber(ngx_var.body_bytes_sent) or 0) > 0
    local duration = ngx_now() - ngx.req.start_time()
    local backend = request.backend(req)
    local ttft = req.stream and req.first or nil
    local pt, ct, kt = usage(req.tail)
    outbox.push(protocol.ended(req.id, backend, status, sent, ttft, duration, req.cut, pt, ct, req.rid, kt,
                               req.who))
    -- For the kvgate log_format (the access log module runs after this phase handler).
    ngx_var.kvgate_backend = backend
    ngx_var.kvgate_route = req.route
    if ttft then
        ngx_var.kvgate_ttft = str_format("%.4f", ttft)
    end
end

return _M
