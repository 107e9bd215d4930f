// pybind11 bindings of the block pool: pyorch._C.BlockPool. Only pybind11 here, no torch.
#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_manager/block_pool.h"

namespace py = pybind11;

namespace pyorch::block {

namespace {

// Token ids [start, start + n) of a Python list (or any sequence) into out. Reading a list
// directly, block by block, spares the lookup a conversion of the whole prompt (a 32k-token
// prompt cost ~0.3 ms to convert before a lookup that missed on its first block).
void read_tokens(const py::sequence& seq, int64_t start, int64_t n, int32_t* out) {
  PyObject* obj = seq.ptr();
  const bool is_list = PyList_Check(obj);
  for (int64_t i = 0; i < n; ++i) {
    PyObject* item = is_list ? PyList_GET_ITEM(obj, start + i) : nullptr;
    py::object owned;
    if (item == nullptr) {
      owned = seq[static_cast<size_t>(start + i)];
      item = owned.ptr();
    }
    const long value = PyLong_AsLong(item);
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (value < INT32_MIN || value > INT32_MAX) {
      throw py::value_error("token id " + std::to_string(value) + " does not fit int32");
    }
    out[i] = static_cast<int32_t>(value);
  }
}

}  // namespace

void bind_block_manager(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool",
                        "Fixed pool of KV-cache blocks with reference counts, an LRU free queue "
                        "and an exact prefix cache of full blocks. Block 0 is the null block.")
      .def(py::init<int32_t, int32_t, bool, int32_t>(), py::arg("num_blocks"),
           py::arg("block_size"), py::arg("enable_caching") = true, py::arg("hash_bits") = 64)
      .def_property_readonly_static("null_block_id",
                                    [](py::object) { return BlockPool::kNullBlockId; })
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def_property_readonly("enable_caching", &BlockPool::enable_caching)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free_blocks)
      .def_property_readonly("num_cached_blocks", &BlockPool::num_cached_blocks)
      .def_property_readonly("usage", &BlockPool::usage)
      .def_property_readonly("prefix_cache_queries", &BlockPool::prefix_cache_queries)
      .def_property_readonly("prefix_cache_hits", &BlockPool::prefix_cache_hits)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("is_cached", &BlockPool::is_cached, py::arg("block_id"))
      .def("allocate", &BlockPool::allocate, py::arg("num_blocks"))
      .def("free", &BlockPool::free, py::arg("block_ids"))
      .def("touch", &BlockPool::touch, py::arg("block_ids"))
      .def(
          "find_longest_prefix",
          [](BlockPool& pool, const py::sequence& token_ids, const std::string& extra_key,
             int64_t max_num_tokens) {
            const auto read = [&token_ids](int64_t start, int64_t n, int32_t* out) {
              read_tokens(token_ids, start, n, out);
            };
            return pool.find_longest_prefix(static_cast<int64_t>(py::len(token_ids)), read,
                                            extra_key, max_num_tokens);
          },
          py::arg("token_ids"), py::arg("extra_key") = std::string(),
          py::arg("max_num_tokens") = INT64_MAX,
          "Longest cached prefix in whole blocks (block ids); reads token_ids only up to the "
          "first block that misses.")
      .def(
          "cache_full_blocks",
          [](BlockPool& pool, int32_t parent_block_id, const std::vector<int32_t>& block_ids,
             const py::sequence& token_ids, const std::string& extra_key, int64_t token_offset) {
            // token_ids[token_offset : token_offset + len(block_ids) * block_size] are the
            // blocks' tokens: the caller passes its whole token list, not a sliced copy.
            const int64_t n = static_cast<int64_t>(block_ids.size()) * pool.block_size();
            const int64_t size = static_cast<int64_t>(py::len(token_ids));
            // token_offset -1: token_ids holds exactly the blocks' tokens.
            const bool exact = token_offset == -1;
            const int64_t start = exact ? 0 : token_offset;
            if (start < 0 || (exact && size != n) || (!exact && size - start < n)) {
              throw py::value_error("BlockPool.cache_full_blocks: expected " + std::to_string(n) +
                                    " token ids from offset " + std::to_string(start) +
                                    ", got a sequence of " + std::to_string(size));
            }
            std::vector<int32_t> tokens(static_cast<size_t>(n));
            read_tokens(token_ids, start, n, tokens.data());
            return pool.cache_full_blocks(parent_block_id, block_ids, tokens.data(), extra_key);
          },
          py::arg("parent_block_id"), py::arg("block_ids"), py::arg("token_ids"),
          py::arg("extra_key") = std::string(), py::arg("token_offset") = -1,
          "Caches full blocks continuing the chain after parent_block_id (-1: a sequence's "
          "first blocks); returns how many are cached afterwards. The blocks' tokens are "
          "token_ids[token_offset:]; without token_offset, token_ids must hold exactly them.")
      .def("reset_prefix_cache", &BlockPool::reset_prefix_cache);
}

}  // namespace pyorch::block
