-- The response's filters. header_filter labels the response with its route and learns whether it is
-- a stream. body_filter marks the first body byte, then watches for the end. For a stream the first
-- byte is the first token (vLLM sends the headers before prefill, the first event after it), so the
-- sidecar stops counting the request in its backend's prefill queue, and this is its TTFT. After it,
-- a chunk costs reading the eof flag; a response that stops without one was cut by the backend (Nginx
-- then makes one last empty call with the upstream finished): a stream gets an error event before the
-- connection closes, and the outcome says "cut".

local conf     = require "kvgate.conf"
local outbox   = require "kvgate.outbox"
local protocol = require "kvgate.protocol"
local request  = require "kvgate.request"

local ngx       = ngx
local ngx_var   = ngx.var
local ngx_now   = ngx.now
local str_find  = string.find
local str_match = string.match
local str_gsub  = string.gsub
local str_sub   = string.sub

local _M = {}

function _M.header_filter()
    local req = request.current()
    if not req or req.tries == 0 then
        return
    end
    if conf.route_headers then
        ngx.header["X-Kvgate-Backend"] = request.backend(req)
        ngx.header["X-Kvgate-Route"] = req.route
    end
    local ctype = ngx.header["Content-Type"]
    req.stream = ctype ~= nil and str_find(ctype, "text/event-stream", 1, true) ~= nil
end

local CUT_EVENT = 'data: {"error":{"message":"The backend closed the stream before it finished.",'
                  .. '"type":"BadGatewayError","param":null,"code":502}}\n\n'

-- Whether the try now answering has finished: $upstream_response_time lists every try ("0.002, -"
-- after a retry) and shows "-" for the one in progress. An empty chunk while it runs is a flush.
local function upstream_done()
    return str_sub(ngx_var.upstream_response_time or "-", -1) ~= "-"
end

local function cut(req)
    req.cut = true
    req.eof = true
    if req.stream then
        ngx.arg[1] = CUT_EVENT
    end
end

-- The response's usage (conf.usage: rate limits count its tokens, the exact index its cached ones)
-- is in the last event of a stream (with include_usage) or near the end of a JSON body: keep the
-- last chunks.
local function keep_tail(req)
    local chunk = ngx.arg[1]
    if chunk ~= "" then
        req.tail = (req.last or "") .. chunk
        req.last = chunk
    end
end

-- The usage event vLLM sends last when asked (stream_options.include_usage): the gateway asked on
-- the client's behalf (rate limits count what was generated), so it is read (keep_tail) and not
-- passed on. An event unfinished at a chunk's end waits for the next chunk: its end says what it is.
local USAGE_EVENT = 'data: {[^\n]-"choices"%s*:%s*%[%s*%][^\n]-"usage"%s*:[^\n]*\n\n'

local function strip_usage(req)
    local chunk = ngx.arg[1]
    if req.carry then
        chunk = req.carry .. chunk
        req.carry = nil
    end
    if not ngx.arg[2] then
        local whole, rest = str_match(chunk, "^(.*\n\n)(.-)$")
        if not whole then
            whole, rest = "", chunk
        end
        if rest ~= "" then
            req.carry, chunk = rest, whole
        end
    end
    -- With include_usage every other event carries "usage":null: gone too, so that the client gets
    -- the stream it asked for.
    ngx.arg[1] = str_gsub(str_gsub(chunk, USAGE_EVENT, ""), ',%s*"usage"%s*:%s*null', "")
end

-- The first body byte: the TTFT, and the reports that must not wait for the end.
local function first_byte(req)
    ngx.update_time()
    req.first = ngx_now() - ngx.req.start_time()
    if req.kind == "responses" then
        -- vLLM keeps the response on this backend: its id is the next turn's session, which may
        -- arrive within milliseconds through any replica, so the binding leaves now.
        req.rid = str_match(ngx.arg[1], '"id"%s*:%s*"(resp_[%w_%-]+)"')
    end
    -- A JSON response's first byte comes with its last (vLLM sends the body whole): its "end" says
    -- all, one report instead of two.
    if req.id and (req.stream or req.rid) then
        outbox.push(protocol.first(req.id, request.backend(req), req.rid))
        if req.rid then
            outbox.flush_now()
        else
            outbox.flush_soon()
        end
    end
end

function _M.body_filter()
    local req = request.current()
    if not req or req.eof or req.tries == 0 then
        return
    end
    if conf.usage then
        keep_tail(req)
    end
    if req.strip_usage and req.stream then
        strip_usage(req)
    end
    if ngx.arg[2] then
        req.eof = true
    end
    if ngx.arg[1] == "" then
        if not req.eof and upstream_done() then
            cut(req)   -- before the first byte (after the headers), or mid-response
        end
        return
    end
    if not req.first then
        first_byte(req)
    end
end

return _M
