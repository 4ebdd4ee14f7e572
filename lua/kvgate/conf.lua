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
    route_headers = true,                       -- X-Kvgate-Backend / X-Kvgate-Route on responses
    max_tries = 3,                              -- candidates Nginx may try for one request
    max_body = "16m",                           -- client_max_body_size, named in the 413 message
    dict = "kvgate",                            -- the lua_shared_dict of the fail-open peers
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
