-- MEMORY: a working memory's document written as the fold of its updates (memfilter.store.memory),
-- only if its updates are still the ones folded: `count` of them (updates are only added, or
-- taken out with an erased thread, so the same count is the same set). Otherwise nothing: the
-- caller folds again. `has_document` 0: no document (every update refused, or none left).
-- KEYS: updates_key document_key
-- ARGV: count has_document document
local updates_key, document_key = KEYS[1], KEYS[2]
local count, has_document, document = ARGV[1], ARGV[2], ARGV[3]
if redis.call('ZCARD', updates_key) ~= tonumber(count) then return 0 end
if has_document == '1' then redis.call('SET', document_key, document) else redis.call('DEL', document_key) end
return 1
