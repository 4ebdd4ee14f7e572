-- API keys at the gateway: Authorization: Bearer <key>, checked against the keys' SHA-256 hashes the
-- sidecar hands out (never the keys). One worker refreshes them every second into the shared dict
-- (auth:keys, auth:classes, auth:rates, auth:version); each worker decodes them once per version.
-- Nginx checks keys itself, so auth holds while the sidecar is away: it fails closed (503 until the
-- keys first arrive). The classes (a key's priority) and rates (its limits, which Nginx routing on
-- its own holds it to) are kept apart from the keys, so that a shared dict filled by an older
-- release still reads after a reload.

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local ffi      = require "ffi"
local protocol = require "kvgate.protocol"
local sidecar  = require "kvgate.sidecar"

local ngx        = ngx
local ngx_log    = ngx.log
local ngx_ERR    = ngx.ERR
local ngx_WARN   = ngx.WARN
local type       = type
local str_byte   = string.byte
local str_format = string.format
local str_match  = string.match
local str_lower  = string.lower
local concat     = table.concat

local REFRESH_S = 1

local _M = {}

-- SHA-256 from the OpenSSL library Nginx is linked with (as OpenResty's resty.sha256 does).
ffi.cdef [[
unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);
]]
local digest = ffi.new("unsigned char[32]")
local hex = {}

local function sha256_hex(s)
    ffi.C.SHA256(s, #s, digest)
    local raw = ffi.string(digest, 32)
    for i = 1, 32 do
        hex[i] = str_format("%02x", str_byte(raw, i))
    end
    return concat(hex)
end
_M.sha256_hex = sha256_hex

local cache = { version = nil, keys = nil, classes = {}, rates = {} }

local function current_keys()
    local dict = ngx.shared[conf.dict]
    local version = dict:get("auth:version")
    if version ~= nil and version ~= cache.version then
        local keys = cjson.decode(dict:get("auth:keys") or "")
        if type(keys) == "table" then
            local classes = cjson.decode(dict:get("auth:classes") or "")
            local rates = cjson.decode(dict:get("auth:rates") or "")
            cache.keys, cache.classes, cache.version = keys, type(classes) == "table" and classes or {}, version
            cache.rates = type(rates) == "table" and rates or {}
        end
    end
    return cache.keys
end

local function refresh(premature)
    if premature then
        return
    end
    local dict = ngx.shared[conf.dict]
    if not dict:add("auth:lock", true, REFRESH_S * 0.9) then
        return
    end
    local reply, err = sidecar.call_keys()
    local version, keys, classes, rates
    if reply then
        version, keys, classes, rates = protocol.key_list(reply)
        err = keys
    end
    if not version then
        ngx_log(ngx_WARN, "kvgate: API key refresh failed, keeping the last keys: ", err)
        return
    end
    if dict:get("auth:version") == version then
        return
    end
    -- The classes and rates first: a worker that sees the new version reads all three.
    local ok, set_err = dict:set("auth:classes", cjson.encode(classes))
    if ok then
        ok, set_err = dict:set("auth:rates", cjson.encode(rates))
    end
    if ok then
        ok, set_err = dict:set("auth:keys", cjson.encode(keys))
    end
    if ok then
        ok, set_err = dict:set("auth:version", version)
    end
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to store the API keys: ", set_err)
    end
end

function _M.init_worker()
    if not conf.auth then
        return
    end
    local ok, err = ngx.timer.every(REFRESH_S, refresh)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to start the API key refresh timer: ", err)
    end
    ok, err = ngx.timer.at(0, refresh)
    if not ok then
        ngx_log(ngx_ERR, "kvgate: failed to schedule the first API key refresh: ", err)
    end
end

-- The calling key's name, or ends the request with 401 (or 503 before any key is known).
function _M.check()
    local keys = current_keys()
    if not keys then
        return errors.send(503, "The gateway is starting: API keys are not loaded yet.")
    end
    local header = ngx.var.http_authorization
    local scheme, key
    if type(header) == "string" then
        scheme, key = str_match(header, "^(%a+)%s+(%S+)%s*$")
    end
    -- The scheme is case-insensitive (RFC 9110): bearer, Bearer and BEARER alike.
    local name = key and str_lower(scheme) == "bearer" and keys[sha256_hex(key)]
    if not name then
        ngx.header["WWW-Authenticate"] = 'Bearer realm="kvgate"'
        return errors.send(401, "Incorrect API key provided.", "invalid_request_error", nil, "invalid_api_key")
    end
    return name
end

-- A key's priority class, for Nginx routing on its own (the sidecar's Admission.priority_of): 0
-- unless the config gives it one. ``name`` comes from check(), which brought the cache up to date.
function _M.priority(name)
    return name and cache.classes[name] or 0
end

-- A key's rate limit, requests and tokens a minute (0: none), for Nginx routing on its own.
function _M.rate(name)
    local r = name and cache.rates[name]
    if type(r) ~= "table" then
        return 0, 0
    end
    return r[1] or 0, r[2] or 0
end

return _M
