-- kvgate's settings on the Nginx side. Set once, from init_by_lua, by configure(); every module reads
-- them from here. The defaults are what `kvgate render-nginx` writes when a setting is not given.

local pairs     = pairs
local type      = type
local error     = error
local tostring  = tostring

local _M = {
    socket = "unix:/tmp/kvgate-sidecar.sock",  -- the sidecar's decision socket
    timeout_ms = 50,                            -- whole budget of one decision call
    report_timeout_ms = 200,                    -- outcome reports and peer refreshes run in timers
    session_header = "X-Session-ID",
    route_headers = false,                      -- X-Kvgate-Backend / X-Kvgate-Route on responses
    max_tries = 3,                              -- candidates Nginx may try for one request
    connect_timeout_ms = 2000,                  -- to a backend, per try
    send_timeout_ms = 60000,
    -- The wait for a response's first byte, per try (then Nginx tries the next candidate, if nothing
    -- reached the client yet). A vLLM stream sends its headers at acceptance; Nginx has one read
    -- timeout per try, so for a stream this also bounds every later silence, the first token's
    -- queueing and prefill included. A JSON response comes whole at the end: each requested token
    -- adds token_timeout_ms, up to max_read_timeout_ms.
    first_byte_timeout_ms = 60000,
    -- ... but past a stream's headers (vLLM sends them at once) the timeout only bounds the stream's
    -- silences, which a busy server can stretch to seconds: a stream's try waits at least this long.
    first_byte_stream_min_ms = 30000,
    token_timeout_ms = 100,
    max_read_timeout_ms = 600000,
    max_body = "16m",                           -- client_max_body_size, named in the 413 message
    dict = "kvgate",                            -- the lua_shared_dict of the fail-open peers
    auth = false,                               -- check API keys (auth.lua); the config has keys
    open_routes = {},                           -- with keys on, routes answered without one: models, metrics
    limits = false,                             -- rate limits apply: read each response's usage
    queue = false,                              -- the gateway queue is on (the sidecar may queue)
    queue_heartbeat_ms = 500,                   -- a queued request hears from the sidecar this often
    -- Drop-in: a Lua module of the edge whose access() runs first on kvgate's routes (a location's
    -- access_by_lua replaces the server's, so the edge's own Lua checks are chained here).
    edge_access = "",
    -- Of the settings kvgate render-nginx took from the config (sidecar/kvgate/agreement.py): sent to
    -- the sidecar, which says whether it runs the same config.
    fingerprint = "",
}

-- Refuses unknown keys and values of the wrong type: a typo in nginx.conf fails at startup.
function _M.configure(opts)
    for k, v in pairs(opts) do
        local current = _M[k]
        if current == nil or k == "configure" then
            error("kvgate: unknown setting " .. tostring(k))
        end
        if type(v) ~= type(current) then
            error("kvgate: setting " .. k .. " must be a " .. type(current) .. ", got " .. type(v))
        end
        _M[k] = v
    end
end

return _M
