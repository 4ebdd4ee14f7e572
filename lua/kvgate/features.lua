-- Request features for routing, computed from the decoded body. Lua twin of
-- sidecar/kvgate/features.py: both are checked against tests/golden/features.json.
--
-- text:   chat -> role .. ":" .. content .. "\n" per message (text parts joined by " ");
--         completions -> the prompt string; responses and embeddings -> their input (a list of
--         messages is read as chat, a string as a prompt), after the instructions as a system message.
-- hashes: h_i = md5(h_{i-1} .. chunk_i), first 16 hex digits, over full CHUNK_BYTES chunks.
-- key:    session header (h:), the previous response (r:), OpenAI user field (u:), else derived from
--         leading content (p:).

local ngx_md5     = ngx.md5
local type        = type
local concat      = table.concat
local str_sub     = string.sub
local math_floor  = math.floor
local math_min    = math.min

local CHUNK_BYTES = 512
local MAX_CHUNKS  = 256   -- 128 KB (~32k tokens), as in features.py
local KEY_BYTES   = 1024
local KEY_CHUNKS  = 16
local KEY_VERBATIM = 64   -- longer session values are stored as their md5: Redis keys stay small

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

-- Returns the canonical text and the text the derived key hashes (nil for completions).
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
        local parts, n, first_user = {}, 0, nil
        for _, m in ipairs(messages) do
            if type(m) == "table" then
                local text = content_text(m.content)
                local role = type(m.role) == "string" and m.role or ""
                n = n + 1
                parts[n] = role .. ":" .. text .. "\n"
                if first_user == nil and role == "user" then
                    first_user = text
                end
            end
        end
        return concat(parts), first_user
    end
    local prompt = body.prompt
    if type(prompt) == "table" and #prompt == 1 then
        prompt = prompt[1]
    end
    return type(prompt) == "string" and prompt or "", nil
end

local function chunk_hashes(text)
    local hashes = {}
    local n = math_min(math_floor(#text / CHUNK_BYTES), MAX_CHUNKS)
    local prev = ""
    for i = 1, n do
        local start = (i - 1) * CHUNK_BYTES + 1
        local h = md5_16(prev .. str_sub(text, start, start + CHUNK_BYTES - 1))
        hashes[i] = h
        prev = h
    end
    return hashes
end

-- body: decoded JSON table; session_value: the session header's value or nil.
function _M.extract(body, session_value)
    local text, first_user = canonical(body)
    local hashes = chunk_hashes(text)
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
    elseif #text > 0 then
        key, source = "p:" .. md5_16(text), "prefix"
    else
        source = "none"
    end
    local model = body.model
    if type(model) ~= "string" or model == "" then
        model = nil
    end
    return { model = model, key = key, key_source = source, hashes = hashes, prompt_bytes = #text }
end

return _M
