-- APPLY: one `persist-messages` event's rows (other services' saves; the processor's own in a
-- rebuild or replay), under the same rules as the filter's base layer where they touch a
-- stored row (memfilter.store.history, `apply`):
-- - another service's save is applied once: its identity (`save_identity`, 8 bytes) is
--   appended to the thread's `saved`, and a save found there is a re-delivery or a repeat and
--   changes nothing (the processor's own events have none: memfilter.store.history);
-- - a row equal to the stored one changes nothing;
-- - a row that would move any stored tool invocation back (to a lower state rank, or away from
--   a terminal state, or drop it) is not saved: the stored row stays, as it does against an
--   echo. So a late or repeated copy of a pending call never undoes the client's result;
-- - no row changes the role of a stored row (`role`, refused before any write);
-- - only the processor's own events and an operator's import (`writer`) save in a thread that
--   has no owner yet; in an erased one (`erased`, `memfilter forget`), only the processor's own
--   (a rebuild of a thread its resource started again, where the operator allows it);
-- - an import writes a thread only where it agrees with it: the stored order and the import's
--   ids agree as far as both go, and a stored row of an imported id is the imported row
--   (`clash` otherwise, before any write);
-- - a superseded id of the event that is a row of this thread, still in its conversation,
--   leaves the conversation (its row stays, marked with the event's request id); a later save
--   of a superseded row updates the row and leaves it out.
-- - with a context budget, a row written gets its token count beside it (`tokens_key`);
-- - the save of the reply the thread is `replying` to (its request id, then `/reply`) ends
--   that reply: the thread is no longer marked (COMMIT marks it). Applied or found applied, a
--   save answers `due` ('1') when requests of the thread wait for their turn and no reply is
--   being made any more: the worker wakes the first (memfilter.runtime.turns).
-- KEYS: rows_key order_key meta_key saved_key superseded_key tokens_key
-- ARGV: epoch resource newest_ms packed_rows packed_roles writer identity packed_ranks packed_superseded request_id packed_counts
local rows_key, order_key, meta_key, saved_key, superseded_key, tokens_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local epoch, resource, newest_ms, packed_rows, packed_roles, writer, identity, packed_ranks, packed_superseded, request_id, packed_counts = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
-- The owner epoch fences: a worker takes one each time it is given partitions, and every
-- write stamps the thread's meta with it; an older one than the thread's is refused.
local stored = tonumber(redis.call('HGET', meta_key, 'epoch') or '0')
local mine = tonumber(epoch)
if mine < stored then return {'fenced', tostring(stored)} end
-- a thread that left Redis (EVICT) is loaded back (RESTORE) before anything is saved in it
if redis.call('HEXISTS', meta_key, 'cold') == 1 then return {'cold', ''} end
local owner = redis.call('HGET', meta_key, 'owner')
if owner and owner ~= resource then return {'ownership', owner} end
if not owner then
  local erased = redis.call('HGET', meta_key, 'erased')
  if erased and writer ~= 'processor' then return {'erased', erased} end
  if writer == 'service' then return {'unowned', ''} end
end
local function due()
  if redis.call('HEXISTS', meta_key, 'waiting') == 1 and redis.call('HEXISTS', meta_key, 'replying') == 0 then return '1' end
  return ''
end
local version = redis.call('HGET', meta_key, 'version') or '0'
local saved = identity ~= '' and (redis.call('GET', saved_key) or '')
if saved then
  local at = string.find(saved, identity, 1, true)
  while at do
    if at % 8 == 1 then return {'ok', version, due()} end
    at = string.find(saved, identity, at + 1, true)
  end
end
local rows = cmsgpack.unpack(packed_rows)
local roles = cmsgpack.unpack(packed_roles)
local ranks = cmsgpack.unpack(packed_ranks)
local terminal = ranks['result']
local function tools(message)
  local out = {}
  local content = type(message) == 'table' and message['content']
  local parts = type(content) == 'table' and content['parts']
  if type(parts) ~= 'table' then return out end
  for _, part in ipairs(parts) do
    local inv = type(part) == 'table' and part['type'] == 'tool-invocation' and part['toolInvocation']
    if type(inv) == 'table' and type(inv['toolCallId']) == 'string' then
      out[inv['toolCallId']] = {ranks[inv['state']] or -1, inv['state']}
    end
  end
  return out
end
local function moves_back(old, new)
  local before, after = tools(old), tools(new)
  for id, was in pairs(before) do
    local now = after[id]
    if now == nil or now[1] < was[1] or (was[1] == terminal and now[2] ~= was[2]) then return true end
  end
  return false
end
if writer == 'import' then
  local order = redis.call('LRANGE', order_key, 0, -1)
  for i = 1, math.min(#order, #rows / 2) do
    if order[i] ~= rows[2 * i - 1] then return {'clash', rows[2 * i - 1]} end
  end
  for i = 1, #rows, 2 do
    local old = redis.call('HGET', rows_key, rows[i])
    if old and (old ~= rows[i + 1] or (i + 1) / 2 > #order) then return {'clash', rows[i]} end
  end
end
local keep = {}
for i = 1, #rows, 2 do
  local old = redis.call('HGET', rows_key, rows[i])
  if old and old ~= rows[i + 1] then
    local ok, stored = pcall(cjson.decode, old)
    if not ok or stored['role'] ~= roles[(i + 1) / 2] then return {'role', rows[i]} end
    local fine, incoming = pcall(cjson.decode, rows[i + 1])
    keep[i] = not fine or moves_back(stored, incoming)
  end
end
if mine > stored then redis.call('HSET', meta_key, 'epoch', epoch) end

if saved then redis.call('SET', saved_key, saved .. identity) end
local counts = cmsgpack.unpack(packed_counts)
local changed = false
for i = 1, #rows, 2 do
  local old = redis.call('HGET', rows_key, rows[i])
  local written = false
  if not old then
    redis.call('HSET', rows_key, rows[i], rows[i + 1])
    redis.call('RPUSH', order_key, rows[i])
    written = true
  elseif old ~= rows[i + 1] and not keep[i] then
    redis.call('HSET', rows_key, rows[i], rows[i + 1])
    written = true
  end
  if written then changed = true end
  if #counts > 0 and (written or redis.call('HEXISTS', tokens_key, rows[i]) == 0) then
    redis.call('HSET', tokens_key, rows[i], counts[(i + 1) / 2])
  end
end
for _, id in ipairs(cmsgpack.unpack(packed_superseded)) do
  if redis.call('HEXISTS', rows_key, id) == 1 and redis.call('HEXISTS', superseded_key, id) == 0 then
    redis.call('LREM', order_key, 1, id)
    redis.call('HSET', superseded_key, id, request_id)
    changed = true
  end
end
local replying = redis.call('HGET', meta_key, 'replying')
if replying and request_id == replying .. '/reply' then redis.call('HDEL', meta_key, 'replying', 'replying_ms') end
if changed then
  if redis.call('HSETNX', meta_key, 'owner', resource) == 1 then redis.call('HDEL', meta_key, 'erased') end
  local newest = tonumber(redis.call('HGET', meta_key, 'newest') or '-1')
  if tonumber(newest_ms) > newest then redis.call('HSET', meta_key, 'newest', newest_ms) end
  version = redis.call('HINCRBY', meta_key, 'version', 1)
end
return {'ok', tostring(version), due()}
