-- RESTORE: a thread that left Redis (EVICT) loaded back from PostgreSQL (memfilter.store.cold,
-- `warm`): its rows, order, superseded rows and saves, as PostgreSQL holds them at
-- `held_version`. Only onto a cold thread at that version: `warm` if another worker loaded it
-- first, `behind` (with the thread's version) if PostgreSQL holds an older one, which EVICT
-- never leaves: nothing is written then.
-- KEYS: rows_key order_key meta_key saved_key superseded_key
-- ARGV: held_version packed_rows packed_order packed_superseded saved
local rows_key, order_key, meta_key, saved_key, superseded_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local held_version, packed_rows, packed_order, packed_superseded, saved = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local meta = redis.call('HMGET', meta_key, 'version', 'cold')
if not meta[2] then return {'warm', meta[1] or '0'} end
if meta[1] ~= held_version then return {'behind', meta[1] or '0'} end
-- in slices: Lua's unpack takes a few thousand values at most
local function each_slice(command, key, values)
  for i = 1, #values, 1000 do redis.call(command, key, unpack(values, i, math.min(i + 999, #values))) end
end
each_slice('HSET', rows_key, cmsgpack.unpack(packed_rows))
each_slice('RPUSH', order_key, cmsgpack.unpack(packed_order))
each_slice('HSET', superseded_key, cmsgpack.unpack(packed_superseded))
if saved ~= '' then redis.call('SET', saved_key, saved) end
redis.call('HDEL', meta_key, 'cold')
return {'ok', meta[1]}
