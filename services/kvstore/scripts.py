"""The kvstore's Redis Lua scripts: every decision that spans several keys is one script, so
several kvstore processes sharing one Redis never see half of another's change.

Keys: ``ds:kv:<hex>`` (a block's metadata hash), ``ds:kv:_stats`` (``blocks``/``bytes``),
``ds:kv:_lru`` (sorted set: hex -> last use) and ``ds:kv:_children`` (hash: parent hex -> how
many stored blocks name it as parent; a block with none is a chain tail, the only kind that
capacity eviction removes).

Lookup reads the LRU index with one native ``ZMSCORE`` (``index.py``), no script: every script
here keeps a block's index entry (score: its ``last_access``) in step with its metadata.
"""

from __future__ import annotations

KEY_PREFIX = "ds:kv:"
STATS_KEY = "ds:kv:_stats"  # not a 64-hex name, so it never collides with a block key
LRU_KEY = "ds:kv:_lru"
CHILDREN_KEY = "ds:kv:_children"
COMMIT_ARGS = 8  # per block: size, tenant, class, parent, now, targets, checksum, attempt
ANY_ATTEMPT = "*"

# KEYS: block keys, STATS_KEY, LRU_KEY, CHILDREN_KEY. ARGV: COMMIT_ARGS per block. The first
# put attempt to commit a block wins (its shards are the block's); a later one only refreshes
# last use and learns (0 in its slot) that its own shards are garbage. Returns one 1/0 per
# block (stored by this call or not), then the store's bytes after the call.
COMMIT = """
local n = #KEYS - 3
local stored, added, out = 0, 0, {}
for i = 1, n do
  local b = (i - 1) * 8
  local hex = string.sub(KEYS[i], 7)
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'last_access', ARGV[b + 5])
    out[i] = 0
  else
    redis.call('HSET', KEYS[i], 'size', ARGV[b + 1], 'tenant', ARGV[b + 2], 'class', ARGV[b + 3],
               'parent', ARGV[b + 4], 'last_access', ARGV[b + 5], 'created', ARGV[b + 5],
               'targets', ARGV[b + 6], 'checksum', ARGV[b + 7], 'attempt', ARGV[b + 8])
    if ARGV[b + 4] ~= '' then redis.call('HINCRBY', KEYS[n + 3], ARGV[b + 4], 1) end
    stored = stored + 1
    added = added + tonumber(ARGV[b + 1])
    out[i] = 1
  end
  redis.call('ZADD', KEYS[n + 2], ARGV[b + 5], hex)
end
if stored > 0 then
  redis.call('HINCRBY', KEYS[n + 1], 'blocks', stored)
  redis.call('HINCRBY', KEYS[n + 1], 'bytes', added)
end
out[n + 1] = tonumber(redis.call('HGET', KEYS[n + 1], 'bytes') or '0')
return out
"""

# KEYS: block keys, STATS_KEY, LRU_KEY, CHILDREN_KEY. ARGV[i]: the put attempt the caller saw
# for block i (ANY_ATTEMPT: whatever is stored), so a reader that found attempt A damaged never
# deletes attempt B written since. Returns {targets, attempt} per block ("" when not deleted).
DELETE = """
local n = #KEYS - 3
local deleted, removed, out = 0, 0, {}
for i = 1, n do
  local v = redis.call('HMGET', KEYS[i], 'size', 'targets', 'attempt', 'parent')
  local hex = string.sub(KEYS[i], 7)
  out[i] = {'', ''}
  if not v[1] then
    redis.call('ZREM', KEYS[n + 2], hex)
  elseif ARGV[i] == '*' or ARGV[i] == (v[3] or '') then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[n + 2], hex)
    deleted = deleted + 1
    removed = removed + tonumber(v[1])
    out[i] = {v[2] or '', v[3] or ''}
    if v[4] and v[4] ~= '' then
      if redis.call('HINCRBY', KEYS[n + 3], v[4], -1) <= 0 then
        redis.call('HDEL', KEYS[n + 3], v[4])
      end
    end
  end
end
if deleted > 0 then
  redis.call('HINCRBY', KEYS[n + 1], 'blocks', -deleted)
  redis.call('HINCRBY', KEYS[n + 1], 'bytes', -removed)
end
return out
"""

# KEYS: STATS_KEY, LRU_KEY, CHILDREN_KEY. ARGV: capacity bytes, most blocks to evict. Walks the
# LRU index from its oldest end and evicts chain tails (no stored child) until the bytes fit;
# a parent left childless that is no more recently used than its evicted child goes next (the
# policy's "deeper first on ties"). Work: O(log n) per evicted block plus the interior blocks
# stepped over, never the whole store. Returns {hex, targets, attempt} per evicted block.
EVICT = """
local cap, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local used = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
local out, cursor, blocks, bytes = {}, 0, 0, 0
while used > cap and #out < limit do
  local batch = redis.call('ZRANGE', KEYS[2], cursor, cursor + 63)
  if #batch == 0 then break end
  for _, hx in ipairs(batch) do
    if used <= cap or #out >= limit then break end
    if tonumber(redis.call('HGET', KEYS[3], hx) or '0') > 0 then
      cursor = cursor + 1
    else
      local cur, climbed = hx, false
      while cur do
        local key = 'ds:kv:' .. cur
        local v = redis.call('HMGET', key, 'size', 'targets', 'attempt', 'parent', 'last_access')
        local rank = redis.call('ZRANK', KEYS[2], cur)
        redis.call('ZREM', KEYS[2], cur)
        if rank and rank < cursor then cursor = cursor - 1 end
        local nxt = nil
        if v[1] then
          redis.call('DEL', key)
          used = used - tonumber(v[1])
          blocks = blocks + 1
          bytes = bytes + tonumber(v[1])
          out[#out + 1] = {cur, v[2] or '', v[3] or ''}
          local p = v[4] or ''
          if p ~= '' and redis.call('HINCRBY', KEYS[3], p, -1) <= 0 then
            redis.call('HDEL', KEYS[3], p)
            local ps = redis.call('ZSCORE', KEYS[2], p)
            if ps and used > cap and #out < limit and tonumber(ps) <= tonumber(v[5] or '0') then
              nxt = p
              climbed = true
            end
          end
        end
        cur = nxt
      end
      if climbed then break end -- ranks before the cursor moved: read the batch again
    end
  end
end
if blocks > 0 then
  redis.call('HINCRBY', KEYS[1], 'blocks', -blocks)
  redis.call('HINCRBY', KEYS[1], 'bytes', -bytes)
end
return out
"""

# KEYS: LRU_KEY. ARGV: now, then the blocks' hex digests concatenated (64 characters each).
# Refresh last use of the blocks that still exist (a deleted one is not brought back).
TOUCH = """
local s = ARGV[2]
for i = 0, #s / 64 - 1 do
  local hex = string.sub(s, i * 64 + 1, i * 64 + 64)
  local key = 'ds:kv:' .. hex
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'last_access', ARGV[1])
    redis.call('ZADD', KEYS[1], ARGV[1], hex)
  end
end
return 0
"""
