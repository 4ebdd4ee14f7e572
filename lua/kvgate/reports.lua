-- Outcome reports: what happened to each routed request goes back to the sidecar, which counts
-- in-flight load and backend health from them. Reports wait in a per-worker buffer that a timer
-- flushes every 100 ms in one line; a response never waits for them.

local conf     = require "kvgate.conf"
local protocol = require "kvgate.protocol"
local sidecar  = require "kvgate.sidecar"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_WARN   = ngx.WARN
local tonumber   = tonumber
local str_gmatch = string.gmatch

local FLUSH_EVERY_S = 0.1    -- outcome reports are flushed in batches this often
local MAX_PENDING   = 10000  -- bound of one worker's unsent outcomes

local _M = {}

local pending, npending = {}, 0
local dropped = 0

local function push(item)
    if npending >= MAX_PENDING then
        dropped = dropped + 1
        return
    end
    npending = npending + 1
    pending[npending] = item
end

-- Outcomes this worker could not buffer (the sidecar did not keep up).
function _M.dropped()
    return dropped
end

local function flush(premature)
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
    local ok, err = ngx.timer.every(FLUSH_EVERY_S, flush)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the report timer: ", err)
    end
end

-- header_filter: route headers, and the first-byte report. A streamed response starts when the first
-- token exists: the backend's prefill for this request is done, which frees its share of the
-- sidecar's prefill-queue estimate right away.
function _M.header_filter()
    local ctx = ngx.ctx
    local tries = ctx.kv_tries
    if not tries or tries == 0 then
        return
    end
    local backend = ctx.kv_ids[tries]
    if conf.route_headers then
        ngx.header["X-Kvgate-Backend"] = backend
        ngx.header["X-Kvgate-Route"] = ctx.kv_route
    end
    if ctx.kv_id then
        push(protocol.first_byte(ctx.kv_id, backend))
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

-- log: the final outcome, and the candidates that failed before the one that answered.
function _M.log()
    local ctx = ngx.ctx
    local ids, tries = ctx.kv_ids, ctx.kv_tries
    if not ids or not tries or tries == 0 then
        return
    end
    local statuses = {}
    for v in str_gmatch(ngx_var.upstream_status or "", "[^,%s]+") do
        statuses[#statuses + 1] = tonumber(v) or 0
    end
    for t = 1, tries - 1 do
        push(protocol.outcome(0, ids[t], statuses[t] or 0, nil, false))
    end
    push(protocol.outcome(ctx.kv_id or 0, ids[tries], statuses[tries] or tonumber(ngx_var.status) or 0,
                          last_number(ngx_var.upstream_header_time),
                          (tonumber(ngx_var.body_bytes_sent) or 0) > 0))
end

return _M
