-- kvgate's settings on the Nginx side. Set once, from init_by_lua, by configure(); every module reads
-- them from here. The settings themselves, their defaults and their types are declared once, in
-- Python (NginxSettings in sidecar/kvgate/nginx_conf.py, defaults from sidecar/kvgate/config/):
-- `kvgate render-nginx` writes the configure() call with every one of them. A test checks that each
-- conf.<name> the Lua reads is either rendered or one of the constants below.

local pairs        = pairs
local error        = error
local tostring     = tostring
local setmetatable = setmetatable

local _M = {
    -- Nginx's own constants, not settings of the config.
    dict = "kvgate",                            -- the lua_shared_dict of the fail-open peers
    limits_dict = "kvgate_limits",              -- and of the fail-open rate-limit windows
    report_timeout_ms = 200,                    -- outcome reports and peer refreshes run in timers
    send_timeout_ms = 60000,                    -- to a backend, per try
}

local constants = {}
for k in pairs(_M) do
    constants[k] = true
end

-- A setting over a constant is a rendering error: it fails at startup.
function _M.configure(opts)
    for k, v in pairs(opts) do
        if constants[k] or k == "configure" then
            error("kvgate: " .. tostring(k) .. " is not a setting")
        end
        _M[k] = v
    end
end

-- A setting read and never configured (a hand-written configure() call that misses one) fails
-- loudly at its first use rather than as nil arithmetic somewhere later.
setmetatable(_M, { __index = function(_, k)
    error("kvgate: setting " .. tostring(k) .. " was not configured; render Nginx with kvgate render-nginx", 2)
end })

return _M
