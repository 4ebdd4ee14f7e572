-- Request features for routing, computed from the decoded body. Lua twin of
-- sidecar/kvgate/features.py: both are checked against tests/golden/features.json.
--
-- text:   chat -> role .. ":" .. content .. "\n" per message (text parts joined by " ");
--         completions -> the prompt string (a batch: its texts one after another); responses and
--         embeddings -> their input (a list of messages is read as chat, a string as a prompt),
--         after the instructions as a system message.
-- hashes: h_i = md5(h_{i-1} .. chunk_i), first 16 hex digits, over full CHUNK_BYTES chunks.
-- key:    session header (h:), the previous response (r:), OpenAI user field (u:), else derived from
--         leading content (p:).

local ffi         = require "ffi"

local ngx_md5     = ngx.md5
local type        = type
local pcall       = pcall
local concat      = table.concat
local str_sub     = string.sub
local math_floor  = math.floor
local math_min    = math.min

local CHUNK_BYTES = 512
local MAX_CHUNKS  = 256   -- 128 KB (~32k tokens), as in features.py
local KEY_BYTES   = 1024
local KEY_CHUNKS  = 16
local KEY_VERBATIM = 64   -- longer session values are stored as their md5: Redis keys stay small

-- Nginx's own MD5, exported by every Nginx build (OpenResty's included): the chunk hashes are fed
-- straight from the message strings, with no substring or concatenation of the prompt, which at 50 KB
-- was most of the gateway's Lua time. Without it (a declaration clash) the same hashes come from
-- ngx.md5 over substrings.
local HAVE_FFI_MD5 = pcall(ffi.cdef, [[
typedef struct { uint64_t bytes; uint32_t a, b, c, d; unsigned char buffer[64]; } kvgate_md5_t;
void ngx_md5_init(kvgate_md5_t *ctx);
void ngx_md5_update(kvgate_md5_t *ctx, const void *data, size_t size);
void ngx_md5_final(unsigned char result[16], kvgate_md5_t *ctx);
]]) and pcall(function() return ffi.C.ngx_md5_init end)
local md5_ctx = HAVE_FFI_MD5 and ffi.new("kvgate_md5_t")
local md5_out = HAVE_FFI_MD5 and ffi.new("unsigned char[16]")
local hex_out = HAVE_FFI_MD5 and ffi.new("char[16]")
local HEX = "0123456789abcdef"
local hex_digit = ffi.new("char[17]", HEX)

local _M = { _VERSION = "0.1.0", CHUNK_BYTES = CHUNK_BYTES }

local function md5_16(s)
    return str_sub(ngx_md5(s), 1, 16)
end

-- "h:abc" for a short value, "h#<md5>" for a long one.
local function session_key(kind, value)
    if #value <= KEY_VERBATIM then
        return kind .. ":" .. value
    end
    return kind .. "#" .. ngx_md5(value)
end
_M.session_key = session_key

local function content_text(content)
    if type(content) == "string" then
        return content
    end
    if type(content) == "table" then
        local parts, n = {}, 0
        for _, part in ipairs(content) do
            if type(part) == "table" and part.type == "text" then
                n = n + 1
                parts[n] = type(part.text) == "string" and part.text or ""
            end
        end
        return concat(parts, " ")
    end
    return ""
end

local function is_message_list(v)
    return type(v) == "table" and type(v[1]) == "table"
end

-- The canonical text as a list of parts (never concatenated: at 50 KB the copy alone costs more
-- than hashing), its length, and the text the derived key hashes (nil for completions).
local function canonical(body)
    local messages = body.messages
    local input = body.input
    if messages == nil and input ~= nil then
        -- /v1/responses and /v1/embeddings: read as chat when the input is a list of messages or
        -- instructions come with it, else as a prompt.
        local instructions = body.instructions
        if is_message_list(input) or type(instructions) == "string" then
            messages = {}
            if type(instructions) == "string" then
                messages[1] = { role = "system", content = instructions }
            end
            if is_message_list(input) then
                for _, m in ipairs(input) do
                    messages[#messages + 1] = m
                end
            elseif type(input) == "string" then
                messages[#messages + 1] = { role = "user", content = input }
            end
        else
            body = { prompt = input }
        end
    end
    if type(messages) == "table" then
        local parts, n, len, first_user = {}, 0, 0, nil
        for _, m in ipairs(messages) do
            if type(m) == "table" then
                local text = content_text(m.content)
                local role = type(m.role) == "string" and m.role or ""
                parts[n + 1], parts[n + 2], parts[n + 3], parts[n + 4] = role, ":", text, "\n"
                n = n + 4
                len = len + #role + #text + 2
                if first_user == nil and role == "user" then
                    first_user = text
                end
            end
        end
        return parts, len, first_user
    end
    local prompt = body.prompt
    if type(prompt) == "table" and #prompt > 0 then
        -- A batch's texts, one after another: the first is a prefix its backend will hold, and the
        -- bytes of all of them are what the backend prefills.
        local len = 0
        for i = 1, #prompt do
            if type(prompt[i]) ~= "string" then
                return { "" }, 0, nil
            end
            len = len + #prompt[i]
        end
        return prompt, len, nil
    end
    prompt = type(prompt) == "string" and prompt or ""
    return { prompt }, #prompt, nil
end

local function hex16(raw)
    for i = 0, 7 do
        local b = raw[i]
        hex_out[2 * i] = hex_digit[math_floor(b / 16)]
        hex_out[2 * i + 1] = hex_digit[b % 16]
    end
    return ffi.string(hex_out, 16)
end

-- Chained chunk hashes over the parts, fed to Nginx's MD5 from the strings themselves.
local function chunk_hashes_ffi(parts, n)
    local C = ffi.C
    local hashes = {}
    if n == 0 then
        return hashes
    end
    local chunk, fill = 1, 0
    C.ngx_md5_init(md5_ctx)
    for i = 1, #parts do
        local part = parts[i]
        local plen, pos = #part, 0
        local ptr = ffi.cast("const char *", part)
        while pos < plen do
            local take = math_min(CHUNK_BYTES - fill, plen - pos)
            C.ngx_md5_update(md5_ctx, ptr + pos, take)
            pos, fill = pos + take, fill + take
            if fill == CHUNK_BYTES then
                C.ngx_md5_final(md5_out, md5_ctx)
                local prev = hex16(md5_out)
                hashes[chunk] = prev
                if chunk == n then
                    return hashes
                end
                chunk, fill = chunk + 1, 0
                C.ngx_md5_init(md5_ctx)
                C.ngx_md5_update(md5_ctx, prev, 16)
            end
        end
    end
    return hashes
end

-- The same hashes from ngx.md5 over substrings (when the FFI declaration is not available).
local function chunk_hashes_plain(parts, n)
    local hashes = {}
    if n == 0 then
        return hashes
    end
    local text = str_sub(concat(parts), 1, n * CHUNK_BYTES)
    local prev = ""
    for i = 1, n do
        local start = (i - 1) * CHUNK_BYTES + 1
        local h = md5_16(prev .. str_sub(text, start, start + CHUNK_BYTES - 1))
        hashes[i] = h
        prev = h
    end
    return hashes
end

local chunk_hashes = HAVE_FFI_MD5 and chunk_hashes_ffi or chunk_hashes_plain

-- body: decoded JSON table; session_value: the session header's value or nil.
function _M.extract(body, session_value)
    local parts, len, first_user = canonical(body)
    local hashes = chunk_hashes(parts, math_min(math_floor(len / CHUNK_BYTES), MAX_CHUNKS))
    local key, source
    local user = body.user
    local previous = body.previous_response_id
    if type(session_value) == "string" and session_value ~= "" then
        key, source = session_key("h", session_value), "header"
    elseif type(previous) == "string" and previous ~= "" then
        key, source = session_key("r", previous), "response"
    elseif type(user) == "string" and user ~= "" then
        key, source = session_key("u", user), "user"
    elseif first_user ~= nil then
        key, source = "p:" .. md5_16(str_sub(first_user, 1, KEY_BYTES)), "prefix"
    elseif #hashes > 0 then
        key, source = "p:" .. hashes[math_min(#hashes, KEY_CHUNKS)], "prefix"
    elseif len > 0 then
        key, source = "p:" .. md5_16(concat(parts)), "prefix"   -- shorter than one chunk
    else
        source = "none"
    end
    local model = body.model
    if type(model) ~= "string" or model == "" then
        model = nil
    end
    return { model = model, key = key, key_source = source, hashes = hashes, prompt_bytes = len }
end

-- For tests: whether the hashes come from the FFI path, and the other path on demand.
_M.ffi_md5 = HAVE_FFI_MD5
function _M.plain_hashes(body)
    local parts, len = canonical(body)
    return chunk_hashes_plain(parts, math_min(math_floor(len / CHUNK_BYTES), MAX_CHUNKS))
end

return _M
