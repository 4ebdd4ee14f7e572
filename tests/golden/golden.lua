-- Runs the Lua twins over the golden files, in a real Nginx (tests/e2e/test_lua_phases.py):
-- GET /test/golden?file=features -> what features.extract computes for each case;
-- GET /test/golden?file=protocol -> what protocol.lua builds and reads for each case.
-- Python compares the answers with the golden expectations.

local cjson    = require "cjson.safe"
local features = require "kvgate.features"
local protocol = require "kvgate.protocol"

local null = cjson.null

local function load(name)
    local f = assert(io.open(ngx.var.golden_dir .. "/" .. name .. ".json", "rb"))
    local data = assert(cjson.decode(f:read("*a")))
    f:close()
    return data
end

local function nn(v)   -- JSON null -> nil
    if v == null then
        return nil
    end
    return v
end

local function run_features()
    local out = {}
    for i, case in ipairs(load("features")) do
        local headers = case.headers ~= null and case.headers or {}
        local f = features.extract(case.body, headers["X-Session-ID"])
        out[i] = { model = f.model or null, key = f.key or null, key_source = f.key_source,
                   hashes = f.hashes, prompt_bytes = f.prompt_bytes, n = #f.hashes,
                   -- the fallback path (ngx.md5 over substrings) must give the same hashes
                   same_without_ffi = table.concat(features.plain_hashes(case.body), ",")
                                      == table.concat(f.hashes, ","),
                   ffi_md5 = features.ffi_md5 }
    end
    return out
end

local function run_protocol()
    local g = load("protocol")
    local out = { version = protocol.VERSION, decide = {}, report = {}, replies = {} }
    for i, case in ipairs(g.decide) do
        local f = case.features
        out.decide[i] = protocol.decide(case.id, { model = nn(f.model), key = nn(f.key),
                                                   key_source = f.key_source, hashes = f.hashes,
                                                   prompt_bytes = f.prompt_bytes,
                                                   client_key = nn(f.client_key),
                                                   client_addr = nn(f.client_addr),
                                                   max_tokens = nn(f.max_tokens),
                                                   priority = nn(f.priority),
                                                   completions = f.completions ~= 1 and f.completions or nil,
                                                   tenant = nn(f.tenant),
                                                   body = nn(case.body) })
    end
    for i, case in ipairs(g.report) do
        local items = {}
        for j, o in ipairs(case.outcomes) do
            if o.kind == "first" then
                items[j] = protocol.first(o.decision_id, o.backend, nn(o.response_id))
            elseif o.kind == "end" then
                items[j] = protocol.ended(nn(o.decision_id), o.backend, o.status, o.sent, nn(o.ttft),
                                          nn(o.duration), o.cut, nn(o.prompt_tokens),
                                          nn(o.completion_tokens), nn(o.response_id),
                                          nn(o.cached_tokens),
                                          { ck = nn(o.client_key), ca = nn(o.client_addr),
                                            tn = nn(o.tenant) })
            elseif o.kind == "try" then
                items[j] = protocol.tried(o.backend, o.status)
            else
                items[j] = protocol.drop(o.decision_id)
            end
        end
        out.report[i] = protocol.report(items)
    end
    out.peers = protocol.peers(g.peers.fingerprint)
    out.models = protocol.models()
    out.keys = protocol.keys()
    for i, case in ipairs(g.replies) do
        local reply, err = protocol.check(case.wire)
        local meaning
        if not reply then
            meaning = { kind = "refused", error = err }
        elseif case.wire.e then
            local d, msg, code, retry_after = protocol.decision(reply)
            meaning = { kind = "error", code = code, message = msg, decision = d ~= nil,
                        retry_after = retry_after }
        elseif case.wire.keys then
            local version, keys, classes, rates = protocol.key_list(reply)
            meaning = { kind = "keys", version = version, keys = keys, priorities = classes, rates = rates }
        elseif protocol.queued(reply) then
            meaning = { kind = "queued", decision_id = reply.i }
        elseif case.wire.c then
            local d = protocol.decision(reply)
            local pairs_, prefill = {}, {}
            for j = 1, #d.ids do
                pairs_[j] = { d.ids[j], d.addrs[j] }
            end
            for j = 1, #(d.prefill_ids or {}) do
                prefill[j] = { d.prefill_ids[j], d.prefill_addrs[j] }
            end
            local fb = d.first_byte_ms or {}
            meaning = { kind = "decision", decision_id = d.id, candidates = pairs_, route = d.route,
                        n = #d.ids, priority = d.priority or null, prefill = prefill, np = #prefill,
                        first_byte_ms = fb, nfb = #fb, max_tokens = d.max_tokens or null }
        elseif case.wire.peers then
            local version, peers, known = protocol.peer_list(reply)
            local list = {}
            for j, p in ipairs(peers) do
                list[j] = { p.id, p.addr }
            end
            meaning = { kind = "peers", version = version, peers = list, n = #list, known = known,
                        fingerprint = reply.fp, auth = reply.au, limits = reply.li }
        else
            meaning = { kind = "models", cards = protocol.model_list(reply) }
        end
        out.replies[i] = meaning
    end
    -- A reply in another version is refused.
    local ok, err = protocol.check({ pv = protocol.VERSION + 1, i = 1, c = {} })
    out.mismatch = { accepted = ok ~= nil, error = err }
    return out
end

local which = ngx.var.arg_file
local result = which == "features" and run_features() or run_protocol()
ngx.header["Content-Type"] = "application/json"
ngx.say(cjson.encode(result))
