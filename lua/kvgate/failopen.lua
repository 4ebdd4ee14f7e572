-- Fail-open routing: when the sidecar errors or times out, Nginx routes on its own over the last
-- healthy peers the sidecar gave it (the class it writes: kvgate.priority). One worker
-- refreshes the list every second into the shared dict (peers:list, peers:version, under a dict:add
-- lock); each worker decodes it once per version.

local agreement = require "kvgate.agreement"
local cjson     = require "cjson.safe"
local conf      = require "kvgate.conf"
local errors    = require "kvgate.errors"
local limits    = require "kvgate.failopen_limits"
local outbox    = require "kvgate.outbox"
local protocol  = require "kvgate.protocol"
local sidecar   = require "kvgate.sidecar"
local stats     = require "kvgate.stats"

local ngx       = ngx
local ngx_log   = ngx.log
local ngx_ERR   = ngx.ERR
local ngx_WARN  = ngx.WARN
local ngx_now   = ngx.now
local ngx_crc32 = ngx.crc32_long
local type      = type
local tostring  = tostring
local math_min  = math.min
local tbl_sort  = table.sort

local REFRESH_S = 1   -- how often one worker refreshes the peer list

local _M = {}

local cache = { version = -1, list = {} }

-- The last known healthy peers, { {id =, addr =}, ... }, and their version (-1 before the first).
function _M.peers()
    local dict = ngx.shared[conf.dict]
    local version = dict:get("peers:version")
    if version ~= nil and version ~= cache.version then
        local decoded = cjson.decode(dict:get("peers:list") or "")
        if type(decoded) == "table" then
            cache.list = decoded
            cache.version = version
        end
    end
    return cache.list, cache.version
end

-- How many backends the sidecar knows (eligible or not) as of its last answer, and whether it answered
-- within the last few refreshes.
function _M.fleet()
    local dict = ngx.shared[conf.dict]
    return dict:get("peers:known"), dict:get("peers:fresh") ~= nil
end

-- Rendezvous (highest-random-weight) hashing over the peers: every worker and replica orders the same
-- peers the same way for a key, and losing one peer moves only its keys. Returns ids, addrs.
function _M.order(key)
    local peers = _M.peers()
    local scored = {}
    local seed = key or tostring(ngx_now())
    for i = 1, #peers do
        local p = peers[i]
        scored[i] = { p = p, s = ngx_crc32(seed .. "|" .. p.id) }
    end
    tbl_sort(scored, function(a, b) return a.s > b.s end)
    local ids, addrs = {}, {}
    for i = 1, math_min(#scored, conf.max_tries) do
        ids[i] = scored[i].p.id
        addrs[i] = scored[i].p.addr
    end
    return ids, addrs
end

-- A request the sidecar did not decide (access's fail-open): ids, addrs on the local ring, counted
-- by ``reason``; or it ends with a 429 when its key or address is over its rate, with a 503 when no
-- peer is known.
function _M.route(id, f, err, reason, answered)
    if not answered then
        -- The sidecar may have made (and counted) the decision we did not wait for.
        outbox.push(protocol.drop(id))
    end
    stats.incr("m:failopen:", reason)
    limits.admit(f)   -- may end it with a 429, before it is logged as routed
    ngx_log(ngx_WARN, "kvgate: sidecar decision failed (", err or "no eligible backend",
            "); routing on the local ring")
    local ids, addrs = _M.order(f.key)
    if #addrs == 0 then
        return errors.send(503, "No healthy backend is available.")
    end
    return ids, addrs
end

local function refresh(premature)
    if premature then
        return
    end
    local dict = ngx.shared[conf.dict]
    local ok = dict:add("peers:lock", true, REFRESH_S * 0.9)
    if not ok then
        return -- another worker refreshes this round
    end
    local reply, err = sidecar.peers()
    local version, peers, known
    if reply then
        version, peers, known = protocol.peer_list(reply)
        err = peers
    end
    if not version then
        ngx_log(ngx_WARN, "kvgate: peer refresh failed, keeping the last list: ", err)
        dict:delete("peers:fresh")
        return
    end
    agreement.observe(reply)
    -- For /kvgate/health: how many backends the sidecar knows, and that it answered lately.
    dict:set("peers:known", known)
    dict:set("peers:fresh", true, REFRESH_S * 3)
    if dict:get("peers:version") == version and dict:get("peers:list") ~= nil then
        return
    end
    local encoded = cjson.encode(peers)
    local set_ok, set_err = dict:set("peers:list", encoded)
    if not set_ok then
        ngx_log(ngx_ERR, "kvgate: failed to store the peer list: ", set_err)
        return
    end
    set_ok, set_err = dict:set("peers:version", version)
    if not set_ok then
        ngx_log(ngx_ERR, "kvgate: failed to store the peer list version: ", set_err)
    end
end

function _M.init_worker()
    local ok, err = ngx.timer.every(REFRESH_S, refresh)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the peer refresh timer: ", err)
    end
    ok, err = ngx.timer.at(0, refresh)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to schedule the first peer refresh: ", err)
    end
end

return _M
