-- Client of the sidecar's socket: one JSON line each way over a unix socket, on keepalive cosockets.
-- Only callable where cosockets are allowed (access, content, timers). What the lines say is
-- kvgate.protocol's business; this module moves them.

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local protocol = require "kvgate.protocol"
local stats    = require "kvgate.stats"

local ngx_socket = ngx.socket.tcp

local _M = {}

local KEEPALIVE_MS   = 60000
local KEEPALIVE_POOL = 64

-- A queued request's wait ends (fail-open) after this many heartbeat periods of silence, plus the
-- decision budget. A dead sidecar closes the connection at once; only a hung one needs the timeout.
-- At two periods, one stall of the sidecar's loop a little over one period (seen: 0.5-1 s, on a host
-- whose cores the engines saturate) sent every waiting request around the queue at once (74 in one
-- second), which is the load the queue was holding back.
local SILENT_BEATS = 4

-- A read that timed out may have lost only to this worker being busy. Nginx handles the events of
-- one wakeup, then expires timers, then looks for new events: an answer that arrived while the worker
-- ran other requests' handlers (a burst of large bodies) is in the socket, unseen, when its timer
-- fires. One more read with a 1 ms timeout takes it (the next wakeup sees events before timers);
-- an answer that is not there costs the wait 1 ms more. Replies taken so are counted by call
-- (kvgate_gateway_late_replies_total): a worker too busy to read in time, not a slow sidecar.
local GRACE_MS = 1

local function read_reply(sock, op, timeout_ms, read_ms)
    local data, err, partial = sock:receive("*l")
    if not data and err == "timeout" then
        sock:settimeouts(timeout_ms, timeout_ms, GRACE_MS)
        local rest
        rest, err = sock:receive("*l")
        sock:settimeouts(timeout_ms, timeout_ms, read_ms)
        if rest then
            data = (partial or "") .. rest
            stats.incr("m:late:", op)
        end
    end
    if not data then
        return nil, "failed to receive: " .. err
    end
    local reply
    reply, err = cjson.decode(data)
    if not reply then
        return nil, "failed to decode: " .. err
    end
    return protocol.check(reply)
end

-- Sends one message and, when want_reply, reads one line back. Returns the reply (checked for the
-- protocol version) or true, else nil and an error string. With wait_ms, a reply saying the request
-- is queued is followed on the same connection: heartbeat lines (each within wait_ms, or the sidecar
-- is taken for gone and the caller falls open) until the decision or an error.
local function call(msg, want_reply, timeout_ms, wait_ms)
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
        reply, err = read_reply(sock, msg.op, timeout_ms, timeout_ms)
        if reply and wait_ms and protocol.queued(reply) then
            sock:settimeouts(timeout_ms, timeout_ms, wait_ms)
            while reply and protocol.queued(reply) do
                reply, err = read_reply(sock, msg.op, timeout_ms, wait_ms)
            end
            if not reply then
                err = "queue wait: " .. err
            end
        end
        if not reply then
            sock:close()
            return nil, err
        end
    end
    ok = sock:setkeepalive(KEEPALIVE_MS, KEEPALIVE_POOL)
    if not ok then
        sock:close()
    end
    return reply
end

function _M.decide(id, features)
    local budget = conf.decision_timeout_ms
    return call(protocol.decide(id, features), true, budget, SILENT_BEATS * conf.queue_heartbeat_ms + budget)
end

function _M.peers()
    return call(protocol.peers(conf.fingerprint), true, conf.report_timeout_ms)
end

function _M.models()
    return call(protocol.models(), true, conf.decision_timeout_ms)
end

function _M.call_keys()
    return call(protocol.keys(), true, conf.report_timeout_ms)
end

function _M.report(outcomes)
    return call(protocol.report(outcomes), false, conf.report_timeout_ms)
end

return _M
