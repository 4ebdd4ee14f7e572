-- Rate limits while Nginx routes on its own. The sidecar counts every request it decides, and what
-- Nginx routed without it once it is back (by usage, kvgate.outcomes), but until then nothing held a
-- key or an address back: a client that can make the sidecar slow could use without limit. Here
-- each key (its rate from the keys reply, kvgate.auth) and each client address
-- (conf.client_*_per_minute) is held to its rate in one-minute windows, counted in a shared dict of
-- their own (conf.limits_dict: full, it evicts the oldest windows, never the peers or the keys)
-- by this Nginx alone. What the sidecar counted before it went away is not seen here, so a client
-- can get one more window's worth per gateway instance, no more. Tokens are estimated as at
-- admission, at 4 bytes a token (the sidecar's ratio before it learns a model's): the prompt plus
-- max_tokens for each completion (none when the request sets no max_tokens: its end counts what it
-- used).

local conf   = require "kvgate.conf"
local auth   = require "kvgate.auth"
local errors = require "kvgate.errors"
local stats  = require "kvgate.stats"

local ngx        = ngx
local ngx_now    = ngx.now
local math_floor = math.floor
local math_ceil  = math.ceil
local tostring   = tostring

local WINDOW_S = 60

local _M = {}

local function over(dict, prefix, rpm, tpm, tokens)
    return (rpm > 0 and (dict:get(prefix .. "r") or 0) + 1 > rpm)
        or (tpm > 0 and (dict:get(prefix .. "t") or 0) + tokens > tpm)
end

local function count(dict, prefix, rpm, tpm, tokens)
    if rpm > 0 then
        dict:incr(prefix .. "r", 1, 0, WINDOW_S * 2)
    end
    if tpm > 0 then
        dict:incr(prefix .. "t", tokens, 0, WINDOW_S * 2)
    end
end

-- Counts a request Nginx routes on its own against its key and its address, or ends it with a 429
-- (and Retry-After: the seconds to the next window) when either is over its rate.
function _M.admit(f)
    local dict = conf.limits and ngx.shared[conf.limits_dict]
    if not dict then
        return   -- no limits, or an http{} rendered by an older release: no dict to count in
    end
    local now = ngx_now()
    local window = math_floor(now / WINDOW_S)
    local tokens = math_ceil((f.prompt_bytes or 0) / 4) + (f.max_tokens or 0) * (f.completions or 1)
    -- Only an identity with a limit is counted (auth.rate of no key is 0, 0).
    local key_r, key_t = auth.rate(f.client_key)
    local ip_r, ip_t = conf.client_requests_per_minute, conf.client_tokens_per_minute
    local key = (key_r > 0 or key_t > 0) and ("fo:" .. window .. ":k:" .. f.client_key .. ":")
    local ip = (ip_r > 0 or ip_t > 0) and f.client_addr and ("fo:" .. window .. ":a:" .. f.client_addr .. ":")
    local refused = key and over(dict, key, key_r, key_t, tokens) and "API key"
        or ip and over(dict, ip, ip_r, ip_t, tokens) and "client address"
    if refused then
        stats.incr("m:failopen_limited:", refused == "API key" and "key" or "address")
        ngx.header["Retry-After"] = tostring(math_ceil((window + 1) * WINDOW_S - now))
        return errors.send(429, "Rate limit reached for this " .. refused .. " while the gateway "
                           .. "routes on its own; retry after the Retry-After seconds.", nil, nil,
                           "rate_limit_exceeded")
    end
    if key then
        count(dict, key, key_r, key_t, tokens)
    end
    if ip then
        count(dict, ip, ip_r, ip_t, tokens)
    end
end

return _M
