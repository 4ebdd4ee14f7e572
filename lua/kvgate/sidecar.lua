-- Client of the sidecar's decision protocol: one JSON object per line over a unix socket, on
-- keepalive cosockets. Only callable where cosockets are allowed (access, content, timers).

local cjson      = require "cjson.safe"
local ngx_socket = ngx.socket.tcp

local _M = { _VERSION = "0.1.0" }

local KEEPALIVE_MS   = 60000
local KEEPALIVE_POOL = 64

local conf = {
    socket = "unix:/tmp/kvgate-sidecar.sock",
    timeout_ms = 50,          -- whole budget of one decision call, in ms
    report_timeout_ms = 200,  -- outcome reports run in a timer, off the request path
}

function _M.configure(opts)
    for k, v in pairs(opts) do
        if conf[k] ~= nil then
            conf[k] = v
        end
    end
end

-- Sends one message and, when want_reply, reads one line back. Returns the decoded reply (or true)
-- or nil and an error string.
local function call(msg, want_reply, timeout_ms)
    local line, err = cjson.encode(msg)
    if not line then
        return nil, "failed to encode: " .. err
    end
    local sock = ngx_socket()
    sock:settimeouts(timeout_ms, timeout_ms, timeout_ms)
    local ok
    ok, err = sock:connect(conf.socket)
    if not ok then
        return nil, "failed to connect: " .. err
    end
    ok, err = sock:send(line .. "\n")
    if not ok then
        sock:close()
        return nil, "failed to send: " .. err
    end
    local reply = true
    if want_reply then
        local data
        data, err = sock:receive("*l")
        if not data then
            sock:close()
            return nil, "failed to receive: " .. err
        end
        reply, err = cjson.decode(data)
        if not reply then
            sock:close()
            return nil, "failed to decode: " .. err
        end
    end
    sock:setkeepalive(KEEPALIVE_MS, KEEPALIVE_POOL)
    return reply
end

function _M.decide(features)
    return call({ op = "decide", f = features }, true, conf.timeout_ms)
end

function _M.peers()
    return call({ op = "peers" }, true, conf.report_timeout_ms)
end

function _M.models()
    return call({ op = "models" }, true, conf.timeout_ms)
end

function _M.report(items)
    return call({ op = "report", o = items }, false, conf.report_timeout_ms)
end

return _M
