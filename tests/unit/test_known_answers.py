"""Known-answer vectors for the formats other hosts and stored data depend on.

Every expected value below is a literal, computed once by hand from the construction each
module's docstring documents (hashlib/hmac/struct/zlib in a scratch session, never by calling
the code under test), so a change to a block's name, a tenant's salt, the KV frame's bytes or
its MAC, or the kvstore's shard bytes fails here even if encoder and decoder change together.
A user notices such a change as every cached prefix turning into a miss after an upgrade, or as
a mixed-version fleet that can no longer read each other's KV.
"""

from __future__ import annotations

from libs.common.hashchain import block_hash, chain_hashes, chain_root, tenant_salt
from libs.engine.kv.transfer import KVHeader, decode_frame, encode_frame, frame_mac, verify
from services.kvstore import ec

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # block size 4: two full blocks and a tail of two

# root = SHA-256(b"deepserve/kv-chain/v1" || u32le(4) || u32le(len(salt)) || salt)
# h[i] = SHA-256(h[i-1] || u32le(token) ...)
UNSALTED_ROOT = "7c20a909087c0fdd53344b87c3da0055c8b443e465ea9cee76b04c4cab722a37"
UNSALTED = [
    "ca2af86203fe5262e2966d480f6fd9b7761601b3c8a532a9c6a46a7b6cbb38a3",
    "eb6ad4a833c8febb91afe67b930718c41d66fb6394ce853c9dca4dbdd09ec197",
]
UNSALTED_TAIL = "86747ef730192637493068ad5f8be10e45b11b8a67b0925a23ac8b2035bb5e44"
SALTED_ROOT = "38418416be906fc6de6b9d577381d379cc4f2c3b3e5822987f49625fa3cb3a8b"  # salt b"tenant-a"
SALTED = [
    "f47927f5d4fa1c33549ad7ec0320f1ca9168aa1aff6686d9f220b082405f40c0",
    "dd0051305de5d636ba20dcdc4642c92b2eab9842d5840f5722ebcee6d61880ec",
]
SALTED_TAIL = "517625abbe0e0802b71400eb996ef0398fbf11344b51b71700a0e9842f30658d"

# tenant_salt = HMAC-SHA-256(secret, b"deepserve/tenant-salt/v1/" || tenant)[:16]
SECRET = b"server-secret"
SALT_ALICE = "0d726f4739328880930651d8e4e616f2"
SALT_BOB = "b65fafa93d7505a705c660440445b82d"
SALT_EMPTY_TENANT = "10f1fd561671d45308501803d3c129ac"
SALT_ALICE_OTHER_SECRET = "f6ef8290817ea0564ec91fb7ed5330ad"  # secret b"another-secret"


def test_unsalted_chain_matches_the_documented_construction() -> None:
    assert chain_root(4).hex() == UNSALTED_ROOT
    assert [h.hex() for h in chain_hashes(TOKENS, 4)] == UNSALTED
    with_tail = chain_hashes(TOKENS, 4, include_partial=True)
    assert [h.hex() for h in with_tail] == [*UNSALTED, UNSALTED_TAIL]
    assert block_hash(bytes.fromhex(UNSALTED_ROOT), TOKENS[:4]).hex() == UNSALTED[0]


def test_salted_chain_matches_the_documented_construction() -> None:
    assert chain_root(4, b"tenant-a").hex() == SALTED_ROOT
    salted = chain_hashes(TOKENS, 4, b"tenant-a", include_partial=True)
    assert [h.hex() for h in salted] == [*SALTED, SALTED_TAIL]


def test_a_token_id_is_four_little_endian_bytes_up_to_the_largest() -> None:
    # SHA-256(chain_root(2) || 00000000 || ffffffff), chain_root(2) computed as above
    expected = "6eb89960429580e6d7dc0fb936503cf5a724c9467d113c3fdc2c41b884bbf7c8"
    assert chain_hashes([0, 0xFFFFFFFF], 2)[0].hex() == expected


def test_tenant_salt_is_the_documented_hmac() -> None:
    assert tenant_salt(SECRET, "alice").hex() == SALT_ALICE
    assert tenant_salt(SECRET, "bob").hex() == SALT_BOB
    assert tenant_salt(SECRET, "").hex() == SALT_EMPTY_TENANT
    assert tenant_salt(b"another-secret", "alice").hex() == SALT_ALICE_OTHER_SECRET


def test_two_tenants_never_share_a_block_name() -> None:
    """Same tokens: one tenant always gets the same names (its cache hits), two tenants never
    share one (no probing another's prompts through cache timing), nor does a tenant share
    with the unsalted namespace."""
    prompt = list(range(100, 164))
    names = {}
    for tenant in ("alice", "bob", "carol", "alice2", ""):
        salt = tenant_salt(SECRET, tenant)
        first = chain_hashes(prompt, 16, salt, include_partial=True)
        assert chain_hashes(prompt, 16, tenant_salt(SECRET, tenant)) == first  # same tenant
        names[tenant] = set(first)
    names["(unsalted)"] = set(chain_hashes(prompt, 16))
    every = [n for s in names.values() for n in s]
    assert len(every) == len(set(every)) == 6 * 4  # no name in two namespaces


# -- the KV frame -----------------------------------------------------------------------------

FRAME_KEY = b"serving-tier-secret"
PAYLOAD = bytes(range(16))  # two blocks of 8 bytes
HEADER = KVHeader(
    model_id="tiny",
    layout_hash="0123abcd",
    block_size=4,
    dtype="bfloat16",
    bytes_per_block=8,
    num_tokens=8,
    first_block=0,
    block_hashes=tuple(UNSALTED),
)
_HEAD_JSON = (
    b'{"model_id":"tiny","layout_hash":"0123abcd","block_size":4,"dtype":"bfloat16",'
    b'"bytes_per_block":8,"num_tokens":8,"first_block":0,"num_blocks":2,'
    b'"chain_hash":"eb6ad4a833c8febb91afe67b930718c41d66fb6394ce853c9dca4dbdd09ec197",'
    b'"block_hashes":["ca2af86203fe5262e2966d480f6fd9b7761601b3c8a532a9c6a46a7b6cbb38a3",'
    b'"eb6ad4a833c8febb91afe67b930718c41d66fb6394ce853c9dca4dbdd09ec197"]'
)
# HMAC-SHA-256(FRAME_KEY, _HEAD_JSON + b"}" + PAYLOAD)
FRAME_MAC = "3c15a29eaaf690bcfe5dcd978c71d936bbf6199958cca8ae9168e5374be9e876"
# b"DSKV" | u16le version 1 | u32le header length (375 unsigned, 448 signed) | header | payload
UNSIGNED_FRAME = bytes.fromhex("44534b56010077010000") + _HEAD_JSON + b"}" + PAYLOAD
SIGNED_FRAME = (
    bytes.fromhex("44534b560100c0010000")
    + _HEAD_JSON
    + b',"mac":"'
    + FRAME_MAC.encode()
    + b'"}'
    + PAYLOAD
)


def test_frame_bytes_are_the_documented_layout() -> None:
    assert encode_frame(HEADER, PAYLOAD) == UNSIGNED_FRAME
    assert encode_frame(HEADER, PAYLOAD, FRAME_KEY) == SIGNED_FRAME


def test_frame_mac_is_hmac_sha256_over_header_without_mac_and_payload() -> None:
    assert frame_mac(FRAME_KEY, HEADER, PAYLOAD) == FRAME_MAC


def test_a_known_frame_decodes_and_verifies() -> None:
    header, payload = decode_frame(SIGNED_FRAME)
    assert header == KVHeader(**{**HEADER.__dict__, "mac": FRAME_MAC})
    assert header.chain_hash == UNSALTED[-1] and header.num_blocks == 2
    assert bytes(payload) == PAYLOAD
    verify(FRAME_KEY, header, payload)  # raises if the MAC were wrong
    unsigned, _ = decode_frame(UNSIGNED_FRAME)
    assert unsigned.mac == "" and unsigned == HEADER


# -- the kvstore shard ------------------------------------------------------------------------


def test_shard_crc_is_zlibs_crc32() -> None:
    assert ec.crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value
    assert ec.crc32(b"hello") == 0x3610A686
    assert ec.crc32(b"xxhello", 2) == 0x3610A686


def test_shard_bytes_are_magic_crc_fragment() -> None:
    # b"DSS1" | u32le zlib CRC-32 of the fragment | fragment
    assert ec.wrap(b"hello") == b"DSS1" + bytes.fromhex("86a61036") + b"hello"
    assert bytes(ec.unwrap(b"DSS1\x86\xa6\x106hello")) == b"hello"
