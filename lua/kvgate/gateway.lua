-- kvgate's entry points for nginx.conf: one per phase, each delegating to the module that owns the
-- job. Decide in access (the only phase here that may do I/O), apply in balancer, label and report in
-- header_filter and log. See docs/architecture.md.

local access   = require "kvgate.access"
local api      = require "kvgate.api"
local auth     = require "kvgate.auth"
local balancer = require "kvgate.balancer"
local conf     = require "kvgate.conf"
local errors   = require "kvgate.errors"
local failopen = require "kvgate.failopen"
local filters  = require "kvgate.filters"
local outbox   = require "kvgate.outbox"
local outcome  = require "kvgate.outcome"

local _M = { _VERSION = "0.2.0" }

_M.configure     = conf.configure       -- init_by_lua
_M.access        = access.run
_M.balancer      = balancer.run
_M.header_filter = filters.header_filter
_M.body_filter   = filters.body_filter
_M.log           = outcome.log
_M.models        = api.models           -- content_by_lua of /v1/models
_M.health        = api.health           -- content_by_lua of /kvgate/health
_M.metrics       = api.metrics          -- content_by_lua of /kvgate/metrics
_M.ready         = api.ready            -- content_by_lua of /health
_M.error_page    = errors.page          -- content_by_lua of the error_page location

function _M.init_worker()
    failopen.init_worker()
    outbox.init_worker()
    auth.init_worker()
end

return _M
