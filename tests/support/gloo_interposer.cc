// A stand-in for a LibTorch that carries its own Gloo: a shared library that defines one of
// Gloo's functions, preloaded (LD_PRELOAD) into gloo_interposed_test so that it comes before
// libgloo in the process's lookup order, as pip's libtorch_cpu.so does in a trainer linked
// `shardcoord_worker torch`. It is never called: the communicator must refuse before.
#include <gloo/transport/tcp/device.h>

#include <cstdio>
#include <cstdlib>

namespace gloo::transport::tcp {

// Exported (the project builds with hidden visibility), as libtorch_cpu.so exports its Gloo.
__attribute__((visibility("default"))) std::shared_ptr<::gloo::transport::Device> CreateDevice(const struct attr&) {
  std::fprintf(stderr, "gloo_interposer: the interposed CreateDevice was called\n");
  std::abort();
}

}  // namespace gloo::transport::tcp
