"""Which data-parallel replica serves which request: balanced by expected tokens, with requests
that share a prompt prefix kept on one replica so its prefix cache serves them all."""
import heapq

# Groups are cut into pieces of at most this fraction of a replica's fair share. Placing
# pieces largest first on the least-loaded replica ends every replica within one piece of the
# mean, so no replica gets more than 1/4 above its share; a cut group recomputes its prefix
# once per piece, which costs little next to the imbalance it avoids.
MAX_PIECE_OF_SHARE = 0.25


def place_requests(prompts: list[list[int]], max_tokens: list[int], num_replicas: int,
                   block_size: int) -> list[list[int]]:
    """The request indices each replica serves, in input order; a request costs its prompt plus
    its max_tokens, and requests whose first KV block is the same form a group."""
    costs = [len(prompt) + n for prompt, n in zip(prompts, max_tokens)]
    groups: dict[object, list[int]] = {}
    for i, prompt in enumerate(prompts):
        key = tuple(prompt[:block_size]) if len(prompt) >= block_size else i
        groups.setdefault(key, []).append(i)
    limit = MAX_PIECE_OF_SHARE * sum(costs) / num_replicas
    pieces = [piece for group in groups.values() for piece in _cut(group, costs, limit)]
    pieces.sort(key=lambda piece: -sum(costs[i] for i in piece))
    loads = [(0, r) for r in range(num_replicas)]  # a heap of (expected tokens, replica)
    placed: list[list[int]] = [[] for _ in range(num_replicas)]
    for piece in pieces:
        load, r = heapq.heappop(loads)
        placed[r].extend(piece)
        heapq.heappush(loads, (load + sum(costs[i] for i in piece), r))
    return [sorted(indices) for indices in placed]


def _cut(group: list[int], costs: list[int], limit: float) -> list[list[int]]:
    """Consecutive pieces of `group` costing at most `limit` each (or one request if more)."""
    pieces, piece, load = [], [], 0
    for i in group:
        if piece and load + costs[i] > limit:
            pieces.append(piece)
            piece, load = [], 0
        piece.append(i)
        load += costs[i]
    pieces.append(piece)
    return pieces
