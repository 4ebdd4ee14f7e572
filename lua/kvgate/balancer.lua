-- The balancer phase: no I/O is allowed here, so it only applies what access decided: the next
-- candidate on each call (Nginx's proxy_next_upstream calls again after a failure).

local balancer = require "ngx.balancer"
local conf     = require "kvgate.conf"
local request  = require "kvgate.request"

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
    local req = request.current()
    local addrs = req.addrs
    local call = req.tries + 1
    req.tries = call
    -- A failure on a reused keepalive connection does not count as a try, so Nginx may call more
    -- times than there are candidates: go round the list again instead of failing the request.
    local i = (call - 1) % #addrs + 1
    local picks = req.picks
    if not picks then
        picks = {}
        req.picks = picks
    end
    picks[call] = i
    if call == 1 and #addrs > 1 then
        local ok, err = balancer.set_more_tries(#addrs - 1)
        if not ok then
            ngx_log(ngx_ERR, "kvgate: failed to set retries: ", err)
        end
    end
    local host, port = split_addr(addrs[i])
    local ok, err = balancer.set_current_peer(host, port)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to set peer ", addrs[i], ": ", err)
        return ngx.exit(ngx.ERROR)
    end
    ok, err = balancer.set_timeouts(conf.connect_timeout_ms / 1000, conf.send_timeout_ms / 1000,
                                    req.read_s[i])
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to set timeouts: ", err)
    end
end

return _M
