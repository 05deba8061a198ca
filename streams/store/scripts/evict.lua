-- EVICT: a thread idle in Redis leaves it, once PostgreSQL holds its latest version
-- (memfilter.store.cold, `evict`). Only if the thread is at `held_version` (what PostgreSQL
-- holds: a write since means it does not hold the latest), not erased and not evicted already;
-- the rows, order, saves, superseded rows and token counts go; the meta stays, marked `cold`,
-- so ownership, versions, erasures and the message-id index answer as before, and every
-- writer (COMMIT, APPLY, ERASE) refuses a cold thread until it is loaded back (RESTORE). The
-- retry window and processed records are left to expire on their own. 1: taken out; 2: nothing
-- to take (out already, or erased: the tombstone is all there is); 0: written since.
-- KEYS: rows_key order_key meta_key saved_key superseded_key tokens_key
-- ARGV: held_version
local rows_key, order_key, meta_key, saved_key, superseded_key, tokens_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local held_version = ARGV[1]
local meta = redis.call('HMGET', meta_key, 'version', 'cold', 'erased')
if meta[1] ~= held_version then return 0 end
if meta[2] or meta[3] then return 2 end  -- out already, or an erasure's tombstone: nothing to take
redis.call('DEL', rows_key, order_key, saved_key, superseded_key, tokens_key)
redis.call('HSET', meta_key, 'cold', '1')
return 1
