-- ERASE: a thread's history removed for good, leaving a tombstone (memfilter.store.history,
-- `erase`). The caller has taken the thread's ids out of the message-id index and dropped its
-- processed records. Refuses an erasure asked at another version than the thread's (`stale`:
-- it moved since the operator looked), and a worker fenced out (`fenced`). An erasure applied
-- before (its identity in `erasures`) changes nothing. The tombstone keeps only what the
-- store needs to refuse the thread from now on: its version (so decisions after it are placed
-- after it in a rebuild), the owner epoch, when it was erased, and the last erasure applied
-- (its re-delivery changes nothing; an earlier one's is refused as stale, and a rebuild, which
-- begins the thread at its last erasure, keeps the same).
-- KEYS: rows_key order_key meta_key saved_key recent_key superseded_key tokens_key waiting_key
-- ARGV: epoch seen_version identity erased_ms
local rows_key, order_key, meta_key, saved_key, recent_key, superseded_key, tokens_key, waiting_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local epoch, seen_version, identity, erased_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local stored = tonumber(redis.call('HGET', meta_key, 'epoch') or '0')
local mine = tonumber(epoch)
if mine < stored then return {'fenced', tostring(stored)} end
-- a thread that left Redis (EVICT) is loaded back first: its ids are taken out of the index from its rows
if redis.call('HEXISTS', meta_key, 'cold') == 1 then return {'cold', ''} end
local version = tonumber(redis.call('HGET', meta_key, 'version') or '0')
local erasures = redis.call('HGET', meta_key, 'erasures') or ''
for at = 1, #erasures, 8 do
  if string.sub(erasures, at, at + 7) == identity then return {'ok', tostring(version)} end
end
-- a thread with no meta at all is one a rebuild starts at its erasure (memfilter.audit.recorded)
if version ~= tonumber(seen_version) and redis.call('EXISTS', meta_key) == 1 then return {'stale', tostring(version)} end
redis.call('DEL', rows_key, order_key, saved_key, recent_key, superseded_key, tokens_key, waiting_key, meta_key)
version = tonumber(seen_version) + 1
redis.call('HSET', meta_key, 'version', version, 'epoch', math.max(mine, stored), 'erased', erased_ms, 'erasures', identity)
return {'ok', tostring(version)}
