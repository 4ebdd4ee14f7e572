-- UTF-8 validation for client text that crosses to the sidecar.

local str_byte = string.byte
local str_find = string.find

local _M = {}

-- True when s is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past
-- U+10FFFF). Text that is not could not be decoded by the sidecar.
function _M.valid(s)
    if not str_find(s, "[\128-\255]") then
        return true
    end
    local i, n = 1, #s
    while i <= n do
        local c = str_byte(s, i)
        if c < 0x80 then
            i = i + 1
        elseif c >= 0xC2 and c <= 0xDF then
            local c2 = str_byte(s, i + 1)
            if not c2 or c2 < 0x80 or c2 > 0xBF then
                return false
            end
            i = i + 2
        elseif c >= 0xE0 and c <= 0xEF then
            local c2, c3 = str_byte(s, i + 1, i + 2)
            if not c3 or c3 < 0x80 or c3 > 0xBF then
                return false
            end
            local lo, hi = 0x80, 0xBF
            if c == 0xE0 then
                lo = 0xA0   -- overlong
            elseif c == 0xED then
                hi = 0x9F   -- U+D800..U+DFFF, the surrogates
            end
            if c2 < lo or c2 > hi then
                return false
            end
            i = i + 3
        elseif c >= 0xF0 and c <= 0xF4 then
            local c2, c3, c4 = str_byte(s, i + 1, i + 3)
            if not c4 or c3 < 0x80 or c3 > 0xBF or c4 < 0x80 or c4 > 0xBF then
                return false
            end
            local lo, hi = 0x80, 0xBF
            if c == 0xF0 then
                lo = 0x90   -- overlong
            elseif c == 0xF4 then
                hi = 0x8F   -- past U+10FFFF
            end
            if c2 < lo or c2 > hi then
                return false
            end
            i = i + 4
        else
            return false
        end
    end
    return true
end

return _M
