-- The prefill leg of a disaggregated request (vLLM's KV connectors, e.g. NixlConnector): before the
-- request is proxied to its decode backend, the same body goes to a prefill backend as a
-- non-streaming, one-token request asking it to keep the KV cache for a remote decoder; what that
-- backend answers in `kv_transfer_params` travels with the request to the decoder, which reads the
-- KV instead of prefilling. Runs in the access phase (a subrequest is I/O; the balancer allows none).
-- A prefill candidate that fails is reported against its backend and the next one is tried; when all
-- fail, the request is served co-located by the decoder: the client never sees a half-done request.
local cjson    = require "cjson.safe"
local jsontext = require "kvgate.jsontext"
local protocol = require "kvgate.protocol"
local outbox   = require "kvgate.outbox"

local ngx_log  = ngx.log
local ngx_WARN = ngx.WARN
local unpack   = unpack

local _M = {}

-- What the prefill leg changes in the client's body (as vLLM's toy proxy does): one token, no stream,
-- the KV kept for a decoder; the decoding-only limits neutralised.
local PREFILL_FIELDS = {
    { "kv_transfer_params", '{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
                            .. '"remote_block_ids":null,"remote_host":null,"remote_port":null}' },
    { "stream", "false" },
    { "stream_options", "null" },
    { "max_tokens", "1" },
}

local function prefill_body(raw, body)
    local fields = { unpack(PREFILL_FIELDS) }
    if body.max_completion_tokens ~= nil then
        fields[#fields + 1] = { "max_completion_tokens", "1" }
    end
    if body.min_tokens ~= nil then
        fields[#fields + 1] = { "min_tokens", "0" }
    end
    return jsontext.with_fields(raw, fields)
end

-- Runs the prefill leg on ids/addrs in order (raw: the client's body as sent, body: decoded).
-- Returns the kv_transfer_params to send the decoder, as JSON text, and the prefill backend's id, or
-- nil when no prefill backend delivered them.
function _M.prefill(raw, body, ids, addrs)
    local data = prefill_body(raw, body)
    local uri = ngx.var.uri
    for i = 1, #addrs do
        local res = ngx.location.capture("/_kvgate/prefill/" .. addrs[i] .. uri,
                                         { method = ngx.HTTP_POST, body = data })
        local params
        if res.status == 200 and res.truncated ~= true and res.body then
            params = jsontext.object_at(res.body, "kv_transfer_params")
        end
        if params and type(cjson.decode(params)) == "table" then
            return params, ids[i]
        end
        if res.status >= 400 and res.status < 500 then
            -- The client's request is at fault (too long, bad field): the decoder will say so, and
            -- no backend is blamed for it.
            return nil
        end
        -- A backend that failed its leg (or answered without KV to hand over) counts against it.
        outbox.push(protocol.tried(ids[i], res.status >= 500 and res.status or 502))
        ngx_log(ngx_WARN, "kvgate: prefill leg on ", ids[i], " failed (", res.status, ")")
    end
    return nil
end

return _M
