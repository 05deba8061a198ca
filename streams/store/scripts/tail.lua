-- TAIL: the thread's order from the first of these message ids (ARGV) stored in it to its
-- end, those rows, and their token counts; one pass over the order, whatever the number of ids.
-- KEYS: rows_key order_key tokens_key
-- ARGV: the message ids to look for
local rows_key, order_key, tokens_key = KEYS[1], KEYS[2], KEYS[3]
local wanted = {}
for i = 1, #ARGV do wanted[ARGV[i]] = true end
local order = redis.call('LRANGE', order_key, 0, -1)
local first
for i, id in ipairs(order) do
  if wanted[id] then first = i break end
end
if first == nil then return {{}, {}, {}} end
local ids = {}
for i = first, #order do ids[#ids + 1] = order[i] end
local function values(key)
  local out = {}
  for i = 1, #ids, 1000 do
    for _, value in ipairs(redis.call('HMGET', key, unpack(ids, i, math.min(i + 999, #ids)))) do
      out[#out + 1] = value
    end
  end
  return out
end
return {ids, values(rows_key), values(tokens_key)}
