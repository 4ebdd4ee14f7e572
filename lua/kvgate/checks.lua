-- What the gateway accepts of a request, before it asks for a decision: a JSON object (no NaN,
-- Infinity or hex numbers, at most MAX_DEPTH deep) whose fields the gateway reads have the right type
-- and size, and a session header it can store. Everything else a backend checks. Each function
-- returns the value, or nil and the message the client gets (with the field it names).

local cjson    = require "cjson.safe"
local conf     = require "kvgate.conf"
local jsontext = require "kvgate.jsontext"
local utf8     = require "kvgate.utf8"

local ngx        = ngx
local io_open    = io.open
local type       = type
local pairs      = pairs
local ipairs     = ipairs
local tonumber   = tonumber
local math_floor = math.floor
local str_find   = string.find

local MAX_DEPTH     = 64
local MAX_TEXT      = 512    -- bytes of the session header or `user`
local MAX_TENANT    = 64     -- bytes of the tenant header (a metric label, a key of the fair order)
local CONTROL       = "[%z\1-\8\10-\31\127]"  -- what a header value may not hold (a tab it may)
local MAX_MODEL     = 256    -- bytes of `model`
local MAX_TOKENS    = 2147483647
local MIN_PRIORITY  = -2147483648
local MAX_PRIORITY  = 2147483647
local TEXT_FIELDS   = { model = MAX_MODEL, user = MAX_TEXT }
local TOKEN_FIELDS  = { "max_tokens", "max_completion_tokens" }

local json = cjson.new()
json.decode_invalid_numbers(false)
json.decode_max_depth(MAX_DEPTH)

local _M = {}

local function read_body()
    ngx.req.read_body()
    local body = ngx.req.get_body_data()
    if body then
        return body
    end
    -- Larger than client_body_buffer_size: Nginx spooled it to a temp file.
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "failed to open body file: " .. err
    end
    body = f:read("*a")
    f:close()
    return body
end

-- The request's JSON body and its raw text, or nil and an error message. Requests without one (a GET,
-- a DELETE, a multipart upload) are routed on their headers alone: an empty table.
function _M.json_body(kind)
    local method = ngx.req.get_method()
    if kind == "multipart" or method == "GET" or method == "DELETE" or method == "HEAD" then
        return {}
    end
    local raw, err = read_body()
    if not raw or raw == "" then
        return nil, err or "The request body is empty; send a JSON object."
    end
    if not str_find(raw, "^%s*{") then
        return nil, "The request body must be a JSON object."
    end
    local body
    body, err = json.decode(raw)
    if not body and err and str_find(err, "unicode escape", 1, true) then
        body, err = json.decode(jsontext.raw_surrogates(raw))   -- lone surrogates, as vLLM takes them
    end
    if type(body) ~= "table" then
        return nil, "The request body is not valid JSON: " .. (err or "not an object") .. "."
    end
    return body, nil, raw
end

local function whole(value, min, max)
    return type(value) == "number" and value == math_floor(value) and value >= min and value <= max
end

-- The tenant the tenant header names (conf.tenant_header), or nil; or nil and the message a request
-- gets when it is anything but one short name (an edge sets it: a malformed one is refused, not
-- guessed at).
function _M.tenant(headers)
    local name = conf.tenant_header
    local value = name ~= "" and headers[name] or nil
    if value == nil then
        return nil
    end
    if type(value) ~= "string" or #value > MAX_TENANT or not str_find(value, "^[%w%._:%-]+$") then
        return nil, "The " .. name .. " header must be one name of 1 to " .. MAX_TENANT
                    .. " letters, digits, '.', '_', ':' or '-'."
    end
    return value
end

-- The fields the gateway reads; returns an error message and its param, or nil. Text that crosses to
-- the sidecar must be UTF-8 and short (long keys would fill Redis).
function _M.invalid(body, session)
    if type(session) == "table" then
        return "Send one " .. conf.session_header .. " header, not several."
    end
    if session ~= nil then
        if #session > MAX_TEXT then
            return "The " .. conf.session_header .. " header is longer than " .. MAX_TEXT .. " bytes."
        end
        if not utf8.valid(session) then
            return "The " .. conf.session_header .. " header is not valid UTF-8 text."
        end
        -- Nginx passes control bytes in a header value on to the backend, whose HTTP parser refuses
        -- the whole request with a plain-text 400 after it was routed on them.
        if str_find(session, CONTROL) then
            return "The " .. conf.session_header .. " header contains a control character."
        end
    end
    for field, max in pairs(TEXT_FIELDS) do
        local value = body[field]
        if value ~= nil then
            if type(value) ~= "string" then
                return "`" .. field .. "` must be a string.", field
            end
            if #value > max then
                return "`" .. field .. "` is longer than " .. max .. " bytes.", field
            end
            if not utf8.valid(value) then
                return "`" .. field .. "` is not valid UTF-8 text.", field
            end
        end
    end
    for _, field in ipairs(TOKEN_FIELDS) do
        local value = body[field]
        if value ~= nil and value ~= cjson.null and not whole(value, 0, MAX_TOKENS) then
            return "`" .. field .. "` must be a whole number of tokens.", field
        end
    end
    local stream = body.stream
    if stream ~= nil and stream ~= cjson.null and type(stream) ~= "boolean" then
        return "`stream` must be true or false.", "stream"
    end
    local priority = body.priority
    if priority ~= nil and priority ~= cjson.null and not whole(priority, MIN_PRIORITY, MAX_PRIORITY) then
        return "`priority` must be a whole number.", "priority"
    end
    local n = body.n
    if n ~= nil and n ~= cjson.null and not whole(n, 1, MAX_TOKENS) then
        return "`n` must be a whole number of at least 1.", "n"
    end
    -- vLLM runs each completion of each prompt as an engine request of its own: one request could
    -- otherwise fill a server, and outrun a token limit that counted it once.
    local most = conf.max_engine_requests
    if (_M.completions(body) or 1) > most then
        return "`n` times the prompts asks for more than " .. most .. " completions.", "n"
    end
end

-- The tokens the client asked for at most (max_completion_tokens first, as vLLM reads them), or nil.
-- Call after invalid(): a number here is a whole one in range.
function _M.max_tokens(body)
    local mt = body.max_completion_tokens
    if type(mt) ~= "number" then
        mt = body.max_tokens
    end
    return type(mt) == "number" and mt or nil
end

-- The completions a request asks for when more than one, each an engine request in vLLM: `n` of
-- each of its prompts (a completions batch: a list of texts, or of lists of token ids); else nil.
-- Call after `n` was checked.
function _M.completions(body)
    local n = type(body.n) == "number" and body.n or 1
    local prompt = body.prompt
    if type(prompt) == "table" and type(prompt[1]) ~= "number" and #prompt > 1 then
        n = n * #prompt
    end
    return n > 1 and n or nil
end

-- The priority the client asked for: the body's (vLLM's field), else an X-Priority header.
function _M.priority(body)
    local p = body.priority
    if type(p) == "number" then
        return p
    end
    p = tonumber(ngx.var.http_x_priority)
    if whole(p, MIN_PRIORITY, MAX_PRIORITY) then
        return p
    end
    return nil
end

-- The body itself, sent with the decision when the exact prefix index needs the prompt's token ids
-- (the sidecar has a backend tokenize it); nil when off, too long, or not a prompt.
function _M.tokenizable(body, raw)
    local most = conf.tokenize_bytes
    if most > 0 and raw and #raw <= most and (body.messages or type(body.prompt) == "string") then
        return raw
    end
    return nil
end

return _M
