-- Edits of a JSON object as text. The gateway adds a few top-level fields to a client's body (the
-- priority it forwards, vLLM's kv_transfer_params) and reads one object back out of a backend's
-- answer. Decoding and re-encoding would change what the client sent: lua-cjson turns an empty array
-- into {} (OpenResty's build can keep it, Debian's cannot) and rounds long numbers. So the text is
-- spliced; a repeated key's last value wins in the JSON readers vLLM uses (Python's json, pydantic).
local cjson = require "cjson.safe"

local str_byte = string.byte
local str_sub  = string.sub
local str_find = string.find
local concat   = table.concat

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

return _M
