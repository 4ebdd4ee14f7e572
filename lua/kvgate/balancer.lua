-- The balancer phase: no I/O is allowed here, so it only applies what access decided, candidate i on
-- the i-th try (Nginx's proxy_next_upstream makes the next try after a failure).

local balancer = require "ngx.balancer"

local ngx       = ngx
local ngx_log   = ngx.log
local ngx_ERR   = ngx.ERR
local tonumber  = tonumber
local str_match = string.match

local _M = {}

local function split_addr(addr)
    local host, port = str_match(addr, "^(.+):(%d+)$")
    return host, tonumber(port)
end

function _M.run()
    local ctx = ngx.ctx
    local addrs = ctx.kv_addrs
    local i = ctx.kv_tries + 1
    if i > #addrs then
        -- Every candidate failed: Nginx answers 502 (JSON through error_page).
        return ngx.exit(502)
    end
    ctx.kv_tries = i
    if i == 1 and #addrs > 1 then
        local ok, err = balancer.set_more_tries(#addrs - 1)
        if not ok then
            ngx_log(ngx_ERR, "kvgate: failed to set retries: ", err)
        end
    end
    local host, port = split_addr(addrs[i])
    local ok, err = balancer.set_current_peer(host, port)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to set peer ", addrs[i], ": ", err)
        return ngx.exit(502)
    end
end

return _M
