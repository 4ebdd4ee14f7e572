-- The outbox of outcome reports: what happened to each routed request goes back to the sidecar,
-- which counts in-flight load, health and TTFT from them (the phases write them: see outcome.lua,
-- filters.lua, disagg.lua, access.lua). Every decision ends in exactly one "end" or "drop" report,
-- whatever path the request takes (see protocol.py). Reports wait in a per-worker buffer that a timer
-- flushes every 100 ms in one line; a response never waits for them. Reports a worker cannot send (it
-- is exiting on a reload, or the send failed) go to a list in the shared dict, which the next flush
-- of any worker sends.

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"

local ngx        = ngx
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_WARN   = ngx.WARN

local FLUSH_EVERY_S  = 0.1     -- outcome reports are flushed in batches this often
local FIRST_FLUSH_S  = 0.005   -- a first-byte report leaves within this (flush_soon)
local MAX_PENDING    = 10000   -- bound of one worker's unsent outcomes
local ORPHANS        = "reports:orphaned"
local MAX_ORPHANS    = 1000    -- batches kept in the shared dict for another worker to send

local _M = {}

local pending, npending = {}, 0
local dropped = 0

-- Keeps a batch in the shared dict for the next flush (of this or another worker).
local function orphan(batch)
    local encoded = cjson.encode(batch)
    local dict = ngx.shared[conf.dict]
    local len, err = dict:rpush(ORPHANS, encoded)
    if not len then
        stats.incr("m:lost:", "dict", #batch)
        ngx_log(ngx_ERR, "kvgate: lost ", #batch, " outcome report(s): ", err)
    elseif len > MAX_ORPHANS then
        local old = dict:lpop(ORPHANS)
        local items = old and cjson.decode(old)
        stats.incr("m:lost:", "overflow", items and #items or 1)
    end
end

function _M.push(item)
    if ngx.worker.exiting() then
        -- No timer will run in this worker again: hand the report to the workers that stay.
        return orphan({ item })
    end
    if npending >= MAX_PENDING then
        dropped = dropped + 1
        stats.incr("m:lost:", "buffer")
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
    stats.flush()
    local dict = ngx.shared[conf.dict]
    local batch = pending
    if npending > 0 then
        pending, npending = {}, 0
    else
        batch = {}
    end
    -- Send orphaned reports too, a bounded number per flush.
    for _ = 1, 10 do
        local raw = dict:lpop(ORPHANS)
        local items = raw and cjson.decode(raw)
        if not items then
            break
        end
        for i = 1, #items do
            batch[#batch + 1] = items[i]
        end
    end
    if #batch == 0 then
        return
    end
    if premature then
        return orphan(batch)   -- the worker is exiting: another one sends them
    end
    local ok, err = sidecar.report(batch)
    if not ok then
        ngx_log(ngx_WARN, "kvgate: could not send ", #batch, " outcome report(s), keeping them: ", err)
        orphan(batch)
    end
end

-- Sends the buffered reports at once (from a zero-delay timer: the filters cannot do I/O).
function _M.flush_now()
    local ok, err = ngx.timer.at(0, flush)
    if not ok then
        ngx_log(ngx_WARN, "kvgate: failed to schedule a report flush: ", err)
    end
end

-- Sends the buffered reports within FIRST_FLUSH_S: a first-byte report frees its request's share of
-- the sidecar's prefill estimate, and every decision made before it arrives sees that backend busier
-- than it is (replayed in virtual time, a 100 ms delay cost kvgate 5 % of its mean TTFT). One timer
-- per worker at a time, so a busy worker still sends one batch per FIRST_FLUSH_S.
local soon = false

local function flush_soon_timer(premature)
    soon = false
    flush(premature)
end

function _M.flush_soon()
    if soon then
        return
    end
    local ok, err = ngx.timer.at(FIRST_FLUSH_S, flush_soon_timer)
    if ok then
        soon = true
    else
        ngx_log(ngx_WARN, "kvgate: failed to schedule a report flush: ", err)
    end
end

function _M.init_worker()
    local ok, err = ngx.timer.every(FLUSH_EVERY_S, flush)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the report timer: ", err)
    end
end

return _M
