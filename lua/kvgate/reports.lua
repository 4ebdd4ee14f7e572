-- Outcome reports: what happened to each routed request goes back to the sidecar, which counts
-- in-flight load, health and TTFT from them. Every decision ends in exactly one "end" or "drop"
-- report, whatever path the request takes (see protocol.py). Reports wait in a per-worker buffer that
-- a timer flushes every 100 ms in one line; a response never waits for them. Reports a worker cannot
-- send (it is exiting on a reload, or the send failed) go to a list in the shared dict, which the
-- next flush of any worker sends.

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local protocol = require "kvgate.protocol"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"

local ngx        = ngx
local ngx_var    = ngx.var
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_WARN   = ngx.WARN
local ngx_now    = ngx.now
local tonumber   = tonumber
local tostring   = tostring
local str_find   = string.find
local str_format = string.format
local str_match  = string.match
local str_gmatch = string.gmatch
local str_gsub   = string.gsub
local str_sub    = string.sub

local FLUSH_EVERY_S  = 0.1     -- outcome reports are flushed in batches this often
local FIRST_FLUSH_S  = 0.005   -- a first-byte report leaves within this (flush_soon)
local MAX_PENDING    = 10000   -- bound of one worker's unsent outcomes
local ORPHANS        = "reports:orphaned"
local MAX_ORPHANS    = 1000    -- batches kept in the shared dict for another worker to send

local _M = {}

local pending, npending = {}, 0
local dropped = 0

-- Requests whose ctx must survive an internal redirect (error_page drops ngx.ctx): the log phase of
-- the error location finds it again through $kvgate_ref.
local stash, stash_seq = {}, 0

function _M.stash(ctx)
    stash_seq = stash_seq + 1
    local ref = tostring(stash_seq)
    stash[ref] = ctx
    ngx_var.kvgate_ref = ref
end

local function unstash()
    local ref = ngx_var.kvgate_ref
    if not ref or ref == "" then
        return nil
    end
    local ctx = stash[ref]
    stash[ref] = nil
    return ctx
end

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

-- header_filter: the route headers, and whether the response is a stream.
function _M.header_filter()
    local ctx = ngx.ctx
    local tries = ctx.kv_tries
    if not tries or tries == 0 then
        return
    end
    if conf.route_headers then
        ngx.header["X-Kvgate-Backend"] = ctx.kv_ids[ctx.kv_picks[tries]]
        ngx.header["X-Kvgate-Route"] = ctx.kv_route
    end
    local ctype = ngx.header["Content-Type"]
    ctx.kv_stream = ctype ~= nil and str_find(ctype, "text/event-stream", 1, true) ~= nil
end

-- body_filter: marks the first body byte, then watches for the end. For a stream the first byte is
-- the first token (vLLM sends the headers before prefill, the first event after it), so the sidecar
-- stops counting the request in its backend's prefill queue, and this is its TTFT. After it, a chunk
-- costs reading the eof flag; a response that stops without one was cut by the backend (Nginx then
-- makes one last empty call with the upstream finished): a stream gets an error event before the
-- connection closes, and the outcome says "cut".
local CUT_EVENT = 'data: {"error":{"message":"The backend closed the stream before it finished.",'
                  .. '"type":"BadGatewayError","param":null,"code":502}}\n\n'

-- Whether the try now answering has finished: $upstream_response_time lists every try ("0.002, -"
-- after a retry) and shows "-" for the one in progress. An empty chunk while it runs is a flush.
local function upstream_done()
    return str_sub(ngx_var.upstream_response_time or "-", -1) ~= "-"
end

local function cut(ctx)
    ctx.kv_cut = true
    ctx.kv_eof = true
    if ctx.kv_stream then
        ngx.arg[1] = CUT_EVENT
    end
end

-- With rate limits on, the response's usage corrects the tokens counted at admission. It is in the
-- last event of a stream (with include_usage) or near the end of a JSON body: keep the last chunks.
local function keep_tail(ctx)
    local chunk = ngx.arg[1]
    if chunk ~= "" then
        ctx.kv_tail = (ctx.kv_last or "") .. chunk
        ctx.kv_last = chunk
    end
end

-- The usage event vLLM sends last when asked (stream_options.include_usage): the gateway asked on
-- the client's behalf (rate limits count what was generated), so it is read (keep_tail) and not
-- passed on. An event unfinished at a chunk's end waits for the next chunk: its end says what it is.
local USAGE_EVENT = 'data: {[^\n]-"choices"%s*:%s*%[%s*%][^\n]-"usage"%s*:[^\n]*\n\n'

local function strip_usage(ctx)
    local chunk = ngx.arg[1]
    if ctx.kv_carry then
        chunk = ctx.kv_carry .. chunk
        ctx.kv_carry = nil
    end
    if not ngx.arg[2] then
        local whole, rest = str_match(chunk, "^(.*\n\n)(.-)$")
        if not whole then
            whole, rest = "", chunk
        end
        if rest ~= "" then
            ctx.kv_carry, chunk = rest, whole
        end
    end
    -- With include_usage every other event carries "usage":null: gone too, so that the client gets
    -- the stream it asked for.
    ngx.arg[1] = str_gsub(str_gsub(chunk, USAGE_EVENT, ""), ',%s*"usage"%s*:%s*null', "")
end

function _M.body_filter()
    local ctx = ngx.ctx
    if ctx.kv_eof or not ctx.kv_tries or ctx.kv_tries == 0 then
        return
    end
    if conf.limits then
        keep_tail(ctx)
    end
    if ctx.kv_strip_usage and ctx.kv_stream then
        strip_usage(ctx)
    end
    if ngx.arg[2] then
        ctx.kv_eof = true
    end
    if not ctx.kv_first then
        if ngx.arg[1] == "" then
            if not ctx.kv_eof and upstream_done() then
                cut(ctx)   -- cut before the first byte (after the headers)
            end
            return
        end
        ngx.update_time()
        ctx.kv_first = ngx_now() - ngx.req.start_time()
        if ctx.kv_kind == "responses" then
            -- vLLM keeps the response on this backend: its id is the next turn's session, which may
            -- arrive within milliseconds through any replica, so the binding leaves now.
            ctx.kv_rid = str_match(ngx.arg[1], '"id"%s*:%s*"(resp_[%w_%-]+)"')
        end
        -- A JSON response's first byte comes with its last (vLLM sends the body whole): its "end"
        -- says all, one report instead of two.
        if ctx.kv_id and (ctx.kv_stream or ctx.kv_rid) then
            _M.push(protocol.first(ctx.kv_id, ctx.kv_ids[ctx.kv_picks[ctx.kv_tries]], ctx.kv_rid))
            if ctx.kv_rid then
                _M.flush_now()
            else
                _M.flush_soon()
            end
        end
        return
    end
    if not ctx.kv_eof and ngx.arg[1] == "" and upstream_done() then
        cut(ctx)
    end
end

-- log: the decision's one final outcome, and the candidates that failed before the one that answered.
function _M.log()
    local ctx = ngx.ctx
    if not ctx.kv_ids then
        ctx = unstash()   -- an internal redirect (error_page) dropped ngx.ctx
        if not ctx then
            return
        end
    else
        unstash()
    end
    local tries = ctx.kv_tries or 0
    if tries == 0 then
        -- The client went away before the request reached a backend.
        if ctx.kv_id then
            _M.push(protocol.drop(ctx.kv_id))
        end
        return
    end
    -- One status per attempt; "-" where none came back (the client went away first): nil here.
    local statuses, n = {}, 0
    for v in str_gmatch(ngx_var.upstream_status or "", "[^,:%s]+") do
        n = n + 1
        statuses[n] = tonumber(v)
    end
    local ids, picks = ctx.kv_ids, ctx.kv_picks
    for t = 1, tries - 1 do
        _M.push(protocol.tried(ids[picks[t]], statuses[t] or 0))
    end
    local status = statuses[tries] or tonumber(ngx_var.status) or 0
    local sent = (tonumber(ngx_var.body_bytes_sent) or 0) > 0
    local duration = ngx_now() - ngx.req.start_time()
    local backend = ids[picks[tries]]
    local ttft = ctx.kv_stream and ctx.kv_first or nil
    local pt, ct
    local tail = ctx.kv_tail
    if tail then
        -- Chat and completions name them prompt/completion tokens; the Responses API input/output.
        pt = tonumber(str_match(tail, '"prompt_tokens"%s*:%s*(%d+)') or str_match(tail, '"input_tokens"%s*:%s*(%d+)'))
        ct = tonumber(str_match(tail, '"completion_tokens"%s*:%s*(%d+)')
                      or str_match(tail, '"output_tokens"%s*:%s*(%d+)'))
    end
    _M.push(protocol.ended(ctx.kv_id, backend, status, sent, ttft, duration, ctx.kv_cut, pt, ct,
                           ctx.kv_rid))
    -- For the kvgate log_format (the access log module runs after this phase handler).
    ngx_var.kvgate_backend = backend
    ngx_var.kvgate_route = ctx.kv_route
    if ttft then
        ngx_var.kvgate_ttft = str_format("%.4f", ttft)
    end
end

return _M
