-- RESTORE: a thread that left Redis (EVICT) loaded back from PostgreSQL (memfilter.store.cold,
-- `warm`) by the worker that owns it: its rows, order, superseded rows and saves, as
-- PostgreSQL holds them at `held_version`. Fenced as every write is (`fenced`): only the
-- thread's owner loads it back, between its own reads and writes, so a thread never turns
-- warm in the middle of its owner's round trip. Only onto a cold thread at that version:
-- `warm` if it is not cold, `behind` (with the thread's version) if PostgreSQL holds an older
-- one, which EVICT never leaves: nothing is written then.
-- KEYS: rows_key order_key meta_key saved_key superseded_key
-- ARGV: epoch held_version packed_rows packed_order packed_superseded saved
local rows_key, order_key, meta_key, saved_key, superseded_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local epoch, held_version, packed_rows, packed_order, packed_superseded, saved = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local meta = redis.call('HMGET', meta_key, 'version', 'cold', 'epoch')
if tonumber(epoch) < tonumber(meta[3] or '0') then return {'fenced', meta[3]} end
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
