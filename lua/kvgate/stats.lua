-- Nginx-side counters, in the shared dict so every worker adds to the same ones and they survive a
-- reload; exported as Prometheus text on /kvgate/metrics (api.lua).

local conf = require "kvgate.conf"

local ngx     = ngx
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local pairs    = pairs
local tostring = tostring
local concat   = table.concat

local _M = {}

-- The decision call as Nginx sees it (socket round trip included), in seconds. Observations collect
-- in per-worker locals and reach the shared dict with the report flush, every 100 ms, so a request
-- pays no dict lock for them.
local DECISION_BUCKETS = { 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1 }
local NBUCKETS = #DECISION_BUCKETS
local counts, sum, count = {}, 0, 0
for i = 1, NBUCKETS + 1 do
    counts[i] = 0
end

function _M.observe_decision(seconds)
    count = count + 1
    sum = sum + seconds
    for i = 1, NBUCKETS do
        if seconds <= DECISION_BUCKETS[i] then
            counts[i] = counts[i] + 1
            return
        end
    end
    counts[NBUCKETS + 1] = counts[NBUCKETS + 1] + 1
end

-- Moves this worker's observations into the shared dict (called from the report flush timer).
function _M.flush()
    if count == 0 then
        return
    end
    local dict = ngx.shared[conf.dict]
    for i = 1, NBUCKETS + 1 do
        if counts[i] > 0 then
            local ok, err = dict:incr("h:decision:" .. i, counts[i], 0)
            if not ok then
                ngx_log(ngx_ERR, "kvgate: failed to record decision latency: ", err)
            end
            counts[i] = 0
        end
    end
    dict:incr("h:decision:sum", sum, 0)
    dict:incr("h:decision:count", count, 0)
    sum, count = 0, 0
end

local FAMILIES = {
    { name = "kvgate_gateway_failopen_total", prefix = "m:failopen:", label = "reason",
      help = "Requests Nginx routed without a sidecar decision, by why: timeout, refused, error." },
    { name = "kvgate_gateway_failopen_limited_total", prefix = "m:failopen_limited:", label = "by",
      help = "Requests refused (429) while Nginx routed on its own: their key or address was over its rate." },
    { name = "kvgate_gateway_late_replies_total", prefix = "m:late:", label = "call",
      help = "Sidecar replies read after their timeout fired: in time, but this worker was busy." },
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
    n = n + 1
    lines[n] = "# HELP kvgate_gateway_decision_seconds The sidecar decision call as Nginx sees it."
    n = n + 1
    lines[n] = "# TYPE kvgate_gateway_decision_seconds histogram"
    local cumulative = 0
    for i = 1, NBUCKETS + 1 do
        cumulative = cumulative + (dict:get("h:decision:" .. i) or 0)
        local le = i <= NBUCKETS and tostring(DECISION_BUCKETS[i]) or "+Inf"
        n = n + 1
        lines[n] = "kvgate_gateway_decision_seconds_bucket{le=\"" .. le .. "\"} " .. cumulative
    end
    n = n + 1
    lines[n] = "kvgate_gateway_decision_seconds_sum " .. (dict:get("h:decision:sum") or 0)
    n = n + 1
    lines[n] = "kvgate_gateway_decision_seconds_count " .. (dict:get("h:decision:count") or 0)
    return concat(lines, "\n") .. "\n"
end

return _M
