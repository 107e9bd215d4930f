// pybind11 bindings of the block pool: pyorch._C.BlockPool. Only pybind11 here, no torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_manager/block_pool.h"

namespace py = pybind11;

namespace pyorch::block {

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
      .def("find_longest_prefix", &BlockPool::find_longest_prefix, py::arg("token_ids"),
           py::arg("extra_key") = std::string(), py::arg("max_num_tokens") = INT64_MAX)
      .def("cache_full_blocks", &BlockPool::cache_full_blocks, py::arg("parent_block_id"),
           py::arg("block_ids"), py::arg("token_ids"), py::arg("extra_key") = std::string())
      .def("reset_prefix_cache", &BlockPool::reset_prefix_cache);
}

}  // namespace pyorch::block
