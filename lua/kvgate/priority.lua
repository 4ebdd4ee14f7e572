-- The class a request runs in inside vLLM (queue.forward_priority): the body field that carries it,
-- and, when Nginx routes on its own, the class the sidecar would have decided.

local auth = require "kvgate.auth"
local conf = require "kvgate.conf"

local str_format = string.format

local _M = {}

-- The class of a request routed without the sidecar (Admission.priority_of there): the client's where
-- clients may set it, else its key's class.
function _M.fail_open(f, key_name)
    local p = conf.client_priority and f.priority or nil
    if p == nil then
        p = auth.priority(key_name)
    end
    return p
end

-- The body field that puts the request in `class` for vLLM's scheduler, or nil when forwarding is off,
-- the gateway did not read the body (`raw` nil: a multipart upload, a GET; it goes as it came) or the
-- body says so already (no field is class 0). The class replaces a priority the client wrote:
-- where clients may not choose, theirs would otherwise reach vLLM and overtake every other request
-- there. The field is appended, not re-encoded: a JSON object's last duplicate key wins in vLLM's
-- parser (Python's json), as in cjson's.
function _M.field(body, raw, class)
    if not conf.forward_priority or not raw then
        return nil
    end
    local own = body.priority
    if own == class or (own == nil and class == 0) then
        return nil
    end
    return { "priority", str_format("%d", class) }
end

return _M
