-- Every error the gateway itself makes, as OpenAI-style JSON: built here and nowhere else, whether Lua
-- answers it (bad input, unknown model, no backend) or Nginx does (413, 502, 503, 504 through
-- error_page). A backend's own error bodies pass through untouched.

local cjson = require "cjson.safe"
local conf  = require "kvgate.conf"
local stats = require "kvgate.stats"

local ngx       = ngx
local ngx_say   = ngx.say
local ngx_exit  = ngx.exit

local _M = {}

local TYPES = {
    [400] = "invalid_request_error",
    [401] = "invalid_request_error",
    [404] = "NotFoundError",
    [405] = "invalid_request_error",
    [411] = "invalid_request_error",
    [414] = "invalid_request_error",
    [431] = "invalid_request_error",
    [494] = "invalid_request_error",
    [505] = "invalid_request_error",
    [413] = "invalid_request_error",
    [429] = "RateLimitError",
    [500] = "InternalServerError",
    [502] = "BadGatewayError",
    [503] = "ServiceUnavailableError",
    [504] = "GatewayTimeoutError",
}

-- What Nginx-made errors say (the status alone is all error_page passes on).
local MESSAGES = {
    [400] = function() return "The request could not be read (a malformed request line, headers or chunked body)." end,
    [404] = function() return "Unknown route." end,
    [405] = function() return "This method is not allowed on this route." end,
    [411] = function() return "The request body needs a Content-Length or chunked encoding." end,
    [413] = function()
        return "The request body is larger than client_max_body_size (" .. conf.client_max_body_size .. ")."
    end,
    [414] = function() return "The request URI is too long." end,
    [431] = function() return "The request headers are too large." end,
    [494] = function() return "The request headers are too large." end,
    [505] = function() return "The HTTP version is not supported." end,
    [500] = function() return "The gateway failed to handle the request." end,
    [502] = function() return "Every candidate backend failed before answering." end,
    [503] = function() return "No healthy backend is available." end,
    [504] = function() return "The backend did not answer in time." end,
}

-- code: OpenAI's error code when it has one (a string such as "invalid_api_key"), else the status.
function _M.body(status, message, typ, param, code)
    return cjson.encode({ error = { message = message, type = typ or TYPES[status] or "Error",
                                    param = param or cjson.null, code = code or status } })
end

-- Answers the request with the error and ends it.
function _M.send(status, message, typ, param, code)
    stats.incr("m:errors:", status)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["Content-Length"] = nil
    ngx_say(_M.body(status, message, typ, param, code))
    return ngx_exit(status)
end

-- content_by_lua of the error_page location: the status Nginx was about to send, as JSON.
function _M.page()
    local status = ngx.status
    if not MESSAGES[status] then
        status = 500
    end
    return _M.send(status, MESSAGES[status]())
end

return _M
