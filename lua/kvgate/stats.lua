-- Nginx-side counters, in the shared dict so every worker adds to the same ones and they survive a
-- reload; exported as Prometheus text on /kvgate/metrics (api.lua).

local conf = require "kvgate.conf"

local ngx     = ngx
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local pairs   = pairs
local concat  = table.concat

local _M = {}

local FAMILIES = {
    { name = "kvgate_gateway_failopen_total", prefix = "m:failopen:", label = "reason",
      help = "Requests Nginx routed without a sidecar decision, by why: timeout, refused, error." },
    { name = "kvgate_gateway_errors_total", prefix = "m:errors:", label = "status",
      help = "Errors the gateway answered itself (OpenAI-style JSON), by HTTP status." },
    { name = "kvgate_gateway_reports_lost_total", prefix = "m:lost:", label = "why",
      help = "Outcome reports that never reached the sidecar, by why." },
}

-- Adds n (default 1) to the counter family prefix .. label value.
function _M.incr(prefix, value, n)
    local ok, err = ngx.shared[conf.dict]:incr(prefix .. value, n or 1, 0)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to count ", prefix, value, ": ", err)
    end
end

function _M.prometheus()
    local dict = ngx.shared[conf.dict]
    local lines, n = {}, 0
    local keys = dict:get_keys(0)
    for _, fam in pairs(FAMILIES) do
        n = n + 1
        lines[n] = "# HELP " .. fam.name .. " " .. fam.help
        n = n + 1
        lines[n] = "# TYPE " .. fam.name .. " counter"
        local plen = #fam.prefix
        for i = 1, #keys do
            local key = keys[i]
            if key:sub(1, plen) == fam.prefix then
                n = n + 1
                lines[n] = fam.name .. "{" .. fam.label .. "=\"" .. key:sub(plen + 1) .. "\"} "
                           .. (dict:get(key) or 0)
            end
        end
    end
    return concat(lines, "\n") .. "\n"
end

return _M
