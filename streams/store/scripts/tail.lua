-- TAIL: the thread's order from the first of these message ids (ARGV) stored in it to its
-- end, and those rows; one pass over the order, whatever the number of ids.
-- KEYS: rows_key order_key
-- ARGV: the message ids to look for
local rows_key, order_key = KEYS[1], KEYS[2]
local wanted = {}
for i = 1, #ARGV do wanted[ARGV[i]] = true end
local order = redis.call('LRANGE', order_key, 0, -1)
local first
for i, id in ipairs(order) do
  if wanted[id] then first = i break end
end
if first == nil then return {{}, {}} end
local ids = {}
for i = first, #order do ids[#ids + 1] = order[i] end
local rows = {}
for i = 1, #ids, 1000 do
  for _, row in ipairs(redis.call('HMGET', rows_key, unpack(ids, i, math.min(i + 999, #ids)))) do
    rows[#rows + 1] = row
  end
end
return {ids, rows}
