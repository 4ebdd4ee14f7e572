-- Whether this Nginx and the sidecar run the same configuration (sidecar/kvgate/agreement.py). Each
-- peer refresh sends the fingerprint of the settings Nginx was rendered with; the sidecar answers with
-- its own, and with whether it checks API keys and rate limits. A different fingerprint is shown in
-- /kvgate/health; where auth or limits differ, Nginx fails closed: every API request gets a 503 until
-- both halves run one config (a key or a limit the sidecar was given must never be silently off).
-- The state lives in the shared dict (config:state), so every worker applies what one refresh saw.

local conf = require "kvgate.conf"

local tostring = tostring

local ngx     = ngx
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR

local STATE = "config:state"

local _M = {}

-- After a peers reply: records "ok", "mismatch" (other settings) or "unsafe" (auth or limits differ).
function _M.observe(reply)
    local state = "ok"
    if reply.fp ~= conf.fingerprint then
        state = "mismatch"
        if (reply.au == true) ~= conf.auth or (reply.li == true) ~= conf.limits then
            state = "unsafe"
        end
    end
    local dict = ngx.shared[conf.dict]
    if state ~= dict:get(STATE) then
        if state ~= "ok" then
            ngx_log(ngx_ERR, "kvgate: this Nginx was rendered from other settings (", conf.fingerprint,
                    ") than the sidecar runs (", tostring(reply.fp), ")",
                    state == "unsafe" and "; auth or rate limits differ: refusing requests until they agree"
                    or "", ". Render Nginx from the sidecar's config (kvgate render-nginx).")
        end
        local ok, err = dict:set(STATE, state)
        if not ok then
            ngx_log(ngx_ERR, "kvgate: failed to record the config agreement: ", err)
        end
    end
end

-- "ok", "mismatch", "unsafe", or "unknown" before the sidecar first answered.
function _M.state()
    return ngx.shared[conf.dict]:get(STATE) or "unknown"
end

-- True when requests must be refused: the halves disagree on auth or rate limits.
function _M.refuses()
    return ngx.shared[conf.dict]:get(STATE) == "unsafe"
end

return _M
