-- Routes Nginx answers itself: /v1/models (from the sidecar, or the last answer while it is away)
-- and /kvgate/health.

local agreement = require "kvgate.agreement"
local auth     = require "kvgate.auth"
local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local failopen = require "kvgate.failopen"
local process  = require "ngx.process"
local protocol = require "kvgate.protocol"
local outbox   = require "kvgate.outbox"
local sidecar  = require "kvgate.sidecar"
local stats    = require "kvgate.stats"

local ngx     = ngx
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR

local _M = {}

-- These routes are read only, as vLLM's are: another method is a 405, as JSON.
local function not_get()
    local method = ngx.req.get_method()
    if method == "GET" or method == "HEAD" then
        return false
    end
    ngx.header["Allow"] = "GET, HEAD"
    errors.send(405, "Method " .. method .. " is not allowed on " .. ngx.var.uri .. "; use GET.")
    return true
end

local function send_json(encoded)
    ngx.header["Content-Type"] = "application/json"
    return ngx.say(encoded)
end

-- With API keys on, the model list and the gateway's metrics need a key too, unless the config
-- opens them (auth.open_routes); /health and /kvgate/health stay open for probes.
local function keyed(route)
    if conf.auth and not conf.open_routes[route] then
        auth.check()   -- ends the request with 401 when the key is missing or wrong
    end
end

function _M.models()
    if not_get() then
        return
    end
    keyed("models")
    local dict = ngx.shared[conf.dict]
    local reply = sidecar.models()
    local cards = reply and protocol.model_list(reply)
    if cards then
        local encoded = cjson.encode({ object = "list", data = cards })
        local ok, err = dict:set("models:last", encoded)
        if not ok then
            ngx_log(ngx_ERR, "kvgate: failed to keep the model list: ", err)
        end
        return send_json(encoded)
    end
    local last = dict:get("models:last")
    if last then
        return send_json(last)
    end
    return errors.send(503, "The model list is unavailable (routing sidecar unreachable).")
end

-- GET /health, as vLLM answers it (200, no body) while the gateway can route: some backend is known
-- healthy to it; else 503 with the reason.
function _M.ready()
    if not_get() then
        return
    end
    local peers = failopen.peers()
    if #peers == 0 then
        return errors.send(503, "No healthy backend is available.")
    end
    ngx.status = 200
    return ngx.exit(200)
end

function _M.metrics()
    if not_get() then
        return
    end
    keyed("metrics")
    ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    return ngx.print(stats.prometheus())
end

function _M.health()
    if not_get() then
        return
    end
    local peers, version = failopen.peers()
    local known, fresh = failopen.fleet()
    -- ok: every backend the sidecar knows takes traffic; degraded: some are excluded (failed health
    -- or scrape, ejected, draining) or the sidecar stopped answering (Nginx routes on its own over the
    -- last list); down: no backend to send a request to.
    -- Config: "mismatch" (this Nginx was rendered from other settings than the sidecar runs) is
    -- degraded; "unsafe" (they differ on auth or rate limits: every request is refused) is down, and
    -- answered 503, so a liveness probe restarts a container that rendered a stale config.
    local config = agreement.state()
    local status = "ok"
    if #peers == 0 or config == "unsafe" then
        status = "down"
    elseif not fresh or (known or 0) > #peers or config == "mismatch" then
        status = "degraded"
    end
    if config == "unsafe" then
        ngx.status = 503
    end
    return send_json(cjson.encode({ status = status, eligible_backends = #peers, known_backends = known or 0,
                                    sidecar = fresh and "ok" or "unreachable", config = config,
                                    config_fingerprint = conf.fingerprint,
                                    fail_open_peers = #peers, peers_version = version,
                                    dropped_reports = outbox.dropped(),
                                    master_pid = process.get_master_pid() }))
end

return _M
