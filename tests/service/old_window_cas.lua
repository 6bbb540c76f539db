
local function find(s, fp)
  local at = string.find(s, fp, 1, true)
  while at and (at - 1) % 8 ~= 0 do at = string.find(s, fp, at + 1, true) end
  return at
end

local function forget(fp)
  local field = string.sub(fp, 1, 1)
  local bucket = redis.call('HGET', KEYS[6], field)
  local at = bucket and find(bucket, fp)
  if not at then return end
  bucket = string.sub(bucket, 1, at - 1) .. string.sub(bucket, at + 8)
  if #bucket == 0 then redis.call('HDEL', KEYS[6], field) else redis.call('HSET', KEYS[6], field, bucket) end
end

local version = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')
if version ~= tonumber(ARGV[1]) then return false end
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
if tonumber(ARGV[2]) >= 0 and total ~= tonumber(ARGV[2]) then return false end
version = version + 1
local first_row = 14 + 2 * tonumber(ARGV[12])
local n_rows = tonumber(ARGV[first_row - 1])
local first_fp = first_row + n_rows
if n_rows > 0 then redis.call('RPUSH', KEYS[5], unpack(ARGV, first_row, first_fp - 1)) end
total = total + n_rows
local base = tonumber(redis.call('HGET', KEYS[1], 'base') or '0')
if total - base > tonumber(ARGV[8]) then  -- past the count bound: the oldest go, down to keep_rows
  local drop = total - base - tonumber(ARGV[9])
  redis.call('LTRIM', KEYS[5], drop, -1)
  base = base + drop
end
local min_time = tonumber(ARGV[10])
while min_time >= 0 and base < total do  -- then any older than the age bound
  local h = redis.call('LINDEX', KEYS[5], 0)
  if not h then break end
  local t = ((string.byte(h, 1) * 256 + string.byte(h, 2)) * 256 + string.byte(h, 3)) * 256 + string.byte(h, 4)
  if t >= min_time then break end
  redis.call('LPOP', KEYS[5])
  base = base + 1
end
redis.call('HSET', KEYS[1], 'total', total, 'base', base)
if ARGV[11] ~= '' then redis.call('HSET', KEYS[1], ARGV[11], 1) end
local events = redis.call('HINCRBY', KEYS[2], 'events', ARGV[4])
redis.call('HSET', KEYS[2], 'version', version, 'blob', ARGV[3], 'updated', ARGV[5], 'logged', total)
for i = 13, first_row - 2, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
if #ARGV >= first_fp then
  local width = tonumber(ARGV[7])
  local n = tonumber(redis.call('HGET', KEYS[1], 'ids') or '0')
  local held = redis.call('STRLEN', KEYS[3]) / 8
  if held > width then  -- the window was made smaller: forget all but the newest `width`, keep them oldest first
    local ring, kept = redis.call('GET', KEYS[3]), {}
    for j = n - held, n - 1 do
      local at = (j % held) * 8
      local fp = string.sub(ring, at + 1, at + 8)
      if j < n - width then forget(fp) else kept[#kept + 1] = fp end
    end
    redis.call('SET', KEYS[3], table.concat(kept))
    n = width
  end
  for i = first_fp, #ARGV do
    local fp = ARGV[i]
    local bucket = redis.call('HGET', KEYS[6], string.sub(fp, 1, 1)) or ''
    if not find(bucket, fp) then  -- a replayed id keeps its place
      local slot = (n % width) * 8
      if n >= width then forget(redis.call('GETRANGE', KEYS[3], slot, slot + 7)) end  -- the oldest
      local field = string.sub(fp, 1, 1)  -- (re-read: forgetting may have changed this bucket)
      redis.call('HSET', KEYS[6], field, (redis.call('HGET', KEYS[6], field) or '') .. fp)
      redis.call('SETRANGE', KEYS[3], slot, fp)
      n = n + 1
      if n == width then  -- just filled: rewrite it at its exact size (growing left up to 2x spare room)
        redis.call('SET', KEYS[3], redis.call('GET', KEYS[3]))
      end
    end
  end
  redis.call('HSET', KEYS[1], 'ids', n)
end
local ttl = tonumber(ARGV[6])
for _, k in ipairs(KEYS) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
return {version, events, total, base}
