-- COMMIT: one request's effect on its thread, atomically (memfilter.store.history, `commit`).
-- Refuses a decision made on a version that has since moved, or on a thread that has left
-- Redis since (`stale`), and a write of a worker whose partitions were given to another that
-- has written this thread since (`fenced`).
-- With a context budget, each row's token count is written beside it (`tokens_key`).
-- KEYS: rows_key order_key meta_key recent_key pending_key after_key superseded_key tokens_key waiting_key
-- A decision that asks the model for an answer marks the thread `replying` to its request
-- (`replying_ms`: its record time) until that reply's save is applied (APPLY).
-- A request that waits for its turn (`wait`, the request as kept) goes at the end of
-- `waiting_key` (meta `waiting` counts them) with its window entry and nothing else, and only
-- while the thread is replying or others wait (else `stale`: decided again). A decision on a
-- wake (`woken`) is of the first of them, which leaves the list; its window entry is there.
-- ARGV: epoch record seen_version resource newest_ms packed_rows ttl entry window_bytes packed_superseded request_id packed_counts replying_ms wait woken
local rows_key, order_key, meta_key, recent_key, pending_key, after_key, superseded_key, tokens_key, waiting_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local epoch, record, seen_version, resource, newest_ms, packed_rows, ttl, entry, window_bytes, packed_superseded, request_id, packed_counts, replying_ms, wait, woken = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14], ARGV[15]
-- The owner epoch fences: a worker takes one each time it is given partitions, and every
-- write stamps the thread's meta with it; an older one than the thread's is refused.
local stored = tonumber(redis.call('HGET', meta_key, 'epoch') or '0')
local mine = tonumber(epoch)
if mine < stored then return {'fenced', tostring(stored)} end
local version = tonumber(redis.call('HGET', meta_key, 'version') or '0')
if version ~= tonumber(seen_version) then return {'stale', tostring(version)} end
-- left Redis since it was read (EVICT): decided again, on the thread loaded back
if redis.call('HEXISTS', meta_key, 'cold') == 1 then return {'stale', tostring(version)} end
if after_key ~= pending_key and redis.call('EXISTS', after_key) == 0 then return {'stale', tostring(version)} end
if wait ~= '' and redis.call('HEXISTS', meta_key, 'replying') == 0 and redis.call('HEXISTS', meta_key, 'waiting') == 0 then return {'stale', tostring(version)} end
if mine > stored then redis.call('HSET', meta_key, 'epoch', epoch) end
local size = tonumber(window_bytes)
if wait ~= '' then
  redis.call('RPUSH', waiting_key, wait)
  redis.call('HINCRBY', meta_key, 'waiting', 1)
  local window = (redis.call('GET', recent_key) or '') .. entry
  if #window > size then window = string.sub(window, #window - size + 1) end
  redis.call('SET', recent_key, window, 'EX', ttl)
  return {'ok', tostring(version)}
end
if woken ~= '' then
  redis.call('LPOP', waiting_key)
  if redis.call('HINCRBY', meta_key, 'waiting', -1) <= 0 then redis.call('HDEL', meta_key, 'waiting') end
end

local rows = cmsgpack.unpack(packed_rows)
local gone = cmsgpack.unpack(packed_superseded)
local counts = cmsgpack.unpack(packed_counts)
if #rows > 0 or #gone > 0 then
  if redis.call('HSETNX', meta_key, 'owner', resource) == 1 then redis.call('HDEL', meta_key, 'erased') end  -- an erased thread started again
  for i = 1, #rows, 2 do
    if redis.call('HSETNX', rows_key, rows[i], rows[i + 1]) == 1 then
      redis.call('RPUSH', order_key, rows[i])
    else
      redis.call('HSET', rows_key, rows[i], rows[i + 1])
    end
  end
  if #counts > 0 then
    local weights = {}
    for i = 1, #rows, 2 do
      weights[i], weights[i + 1] = rows[i], counts[(i + 1) / 2]
    end
    redis.call('HSET', tokens_key, unpack(weights))
  end
  for _, id in ipairs(gone) do
    if redis.call('LREM', order_key, 1, id) > 0 then redis.call('HSET', superseded_key, id, request_id) end
  end
  local newest = tonumber(redis.call('HGET', meta_key, 'newest') or '-1')
  if tonumber(newest_ms) > newest then redis.call('HSET', meta_key, 'newest', newest_ms) end
  version = version + 1
  redis.call('HSET', meta_key, 'version', version)
end
if tonumber(replying_ms) >= 0 then redis.call('HSET', meta_key, 'replying', request_id, 'replying_ms', replying_ms) end
redis.call('SET', pending_key, record, 'EX', ttl)
if woken == '' then
  local window = (redis.call('GET', recent_key) or '') .. entry
  if #window > size then window = string.sub(window, #window - size + 1) end
  redis.call('SET', recent_key, window, 'EX', ttl)
end
return {'ok', tostring(version)}
