-- Edits of a JSON object as text. The gateway adds a few top-level fields to a client's body (the
-- priority it forwards, vLLM's kv_transfer_params) and reads one object back out of a backend's
-- answer. Decoding and re-encoding would change what the client sent: lua-cjson turns an empty array
-- into {} (OpenResty's build can keep it, Debian's cannot) and rounds long numbers. So the text is
-- spliced; a repeated key's last value wins in the JSON readers vLLM uses (Python's json, pydantic).
local cjson = require "cjson.safe"

local str_byte   = string.byte
local str_char   = string.char
local str_sub    = string.sub
local str_find   = string.find
local concat     = table.concat
local tonumber   = tonumber
local math_floor = math.floor

local _M = {}

local CLOSE, OPEN, QUOTE, BACKSLASH = 125, 123, 34, 92   -- } { " \

-- raw (one JSON object) with fields appended: fields is a list of { key, json_text_of_value }.
function _M.with_fields(raw, fields)
    local pos = #raw
    while pos > 0 and str_byte(raw, pos) ~= CLOSE do
        pos = pos - 1
    end
    if pos == 0 or #fields == 0 then
        return raw
    end
    local head = str_sub(raw, 1, pos - 1)
    local parts = {}
    for i = 1, #fields do
        parts[i] = cjson.encode(fields[i][1]) .. ":" .. fields[i][2]
    end
    local empty = str_find(head, "^%s*{%s*$") ~= nil
    return head .. (empty and "" or ",") .. concat(parts, ",") .. str_sub(raw, pos)
end

-- The text of the object that is the value of top-level-or-nested key `key` (its first occurrence),
-- or nil. Strings are skipped quote-aware, so braces inside them do not count.
function _M.object_at(raw, key)
    local _, finish = str_find(raw, '"' .. key .. '"%s*:%s*{')
    if not finish then
        return nil
    end
    local depth, quoted, escaped = 0, false, false
    for i = finish, #raw do
        local b = str_byte(raw, i)
        if escaped then
            escaped = false
        elseif b == BACKSLASH then
            escaped = quoted
        elseif b == QUOTE then
            quoted = not quoted
        elseif not quoted and b == OPEN then
            depth = depth + 1
        elseif not quoted and b == CLOSE then
            depth = depth - 1
            if depth == 0 then
                return str_sub(raw, finish, i)
            end
        end
    end
    return nil
end

-- raw with each lone surrogate escape (\uD800-\uDFFF not in a high-low pair) written as the three
-- bytes a UTF-8 encoder that lets surrogates pass writes for it (Python's "surrogatepass", the
-- feature twin's). lua-cjson refuses such escapes; Python's json, which vLLM reads with, takes them:
-- this text is for the gateway's own reading of the body, which goes to the backend as sent.
local BS, U = 92, 117
local function hex4(raw, i)
    return tonumber(str_sub(raw, i, i + 3), 16)
end

function _M.raw_surrogates(raw)
    local out, last, i, n = {}, 1, 1, #raw
    while true do
        i = str_find(raw, "\\", i, true)
        if not i or i >= n then
            break
        end
        local cp = str_byte(raw, i + 1) == U and hex4(raw, i + 2)
        if cp and cp >= 0xD800 and cp <= 0xDFFF then
            local low = cp <= 0xDBFF and str_byte(raw, i + 6) == BS and str_byte(raw, i + 7) == U
                        and hex4(raw, i + 8)
            if low and low >= 0xDC00 and low <= 0xDFFF then
                i = i + 12   -- a valid pair: cjson reads it
            else
                out[#out + 1] = str_sub(raw, last, i - 1)
                out[#out + 1] = str_char(0xE0 + math_floor(cp / 4096), 0x80 + math_floor(cp / 64) % 64,
                                         0x80 + cp % 64)
                i = i + 6
                last = i
            end
        else
            i = i + 2   -- any other escape, \\ included: its second character is not a new escape
        end
    end
    if last == 1 then
        return raw
    end
    out[#out + 1] = str_sub(raw, last)
    return concat(out)
end

return _M
