-- Where one request's time goes in kvgate's Lua, phase by phase, measured inside Nginx with the
-- gateway's own modules (benchmark only, never loaded by the gateway). GET /phases?size=N&n=M runs
-- each phase M times on a chat body of N bytes and answers the median microseconds of each.

local ffi      = require "ffi"
local cjson    = require "cjson.safe"
local features = require "kvgate.features"
local protocol = require "kvgate.protocol"
local sidecar  = require "kvgate.sidecar"

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } kvgate_bench_timespec;
int clock_gettime(int clk_id, kvgate_bench_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local ts = ffi.new("kvgate_bench_timespec")

local function now_us()
    ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

-- The gateway's decoder settings (access.lua).
local json = cjson.new()
json.decode_invalid_numbers(false)
json.decode_max_depth(64)

local function body_of(size, i)
    local text = ("request " .. i .. " " .. string.rep("lorem ipsum dolor sit amet ", size / 27 + 1))
    return cjson.encode({ model = "bench-model", max_tokens = 1,
                          messages = { { role = "user", content = text:sub(1, size) } } })
end

local function median(values)
    table.sort(values)
    return values[math.floor(#values / 2) + 1]
end

local _M = {}

function _M.run()
    local size = tonumber(ngx.var.arg_size) or 1024
    local n = tonumber(ngx.var.arg_n) or 200
    local t = { decode = {}, features = {}, encode = {}, round_trip = {}, report_encode = {} }
    local drops = {}
    for i = 1, n do
        local raw = body_of(size, i)
        local t0 = now_us()
        local body = json.decode(raw)
        local t1 = now_us()
        local f = features.extract(body, nil)
        local t2 = now_us()
        local id = "phases." .. ngx.worker.pid() .. "." .. ngx.now() .. "." .. i
        local line = cjson.encode(protocol.decide(id, f))
        local t3 = now_us()
        local reply, err = sidecar.decide(id, f)
        local t4 = now_us()
        if not reply then
            ngx.status = 502
            ngx.say(cjson.encode({ error = "decision failed: " .. tostring(err) }))
            return
        end
        local report = cjson.encode(protocol.report({ protocol.ended(id, "static", 200, true, nil, 0.01) }))
        local t5 = now_us()
        drops[#drops + 1] = protocol.drop(id)
        t.decode[i], t.features[i], t.encode[i] = t1 - t0, t2 - t1, t3 - t2
        t.round_trip[i], t.report_encode[i] = t4 - t3, t5 - t4
        assert(line and report)
    end
    sidecar.report(drops)   -- the decisions made here end, as the gateway's would
    local out = { size = size, n = n }
    for k, v in pairs(t) do
        out[k] = median(v)
    end
    ngx.header["Content-Type"] = "application/json"
    ngx.say(cjson.encode(out))
end

return _M
