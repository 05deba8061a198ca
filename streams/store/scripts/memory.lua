-- MEMORY: a working memory's document written as the fold of its first `count` updates
-- (memfilter.store.memory), only if its updates are still those: `count` of them (updates are
-- only added, or taken out with an erased thread, so the same count is the same set).
-- Otherwise nothing: the caller folds again. `has_document` 0: no document (every update
-- refused, or none left). `folded` keeps how many updates the document folds, so that the next
-- update, when it comes last, is folded onto it alone.
-- KEYS: updates_key document_key folded_key
-- ARGV: count has_document document
local updates_key, document_key, folded_key = KEYS[1], KEYS[2], KEYS[3]
local count, has_document, document = ARGV[1], ARGV[2], ARGV[3]
if redis.call('ZCARD', updates_key) ~= tonumber(count) then return 0 end
if has_document == '1' then redis.call('SET', document_key, document) else redis.call('DEL', document_key) end
redis.call('SET', folded_key, count)
return 1
