/*
 * tvmkv's stand-in for the one TVM header the apache-tvm 0.27 wheel includes but does not ship,
 * written for building TVM's Disco NCCL backend (the wheel's own nccl.cc) as a plugin
 * (tvmkv/disco/nccl.py). Only what <tvm/runtime/tensor.h> uses: a byte stream with typed reads and
 * writes of trivially copyable values and arrays of them. No serializer of containers is needed there.
 */
#ifndef TVMKV_DISCO_SUPPORT_IO_H_
#define TVMKV_DISCO_SUPPORT_IO_H_

#include <cstddef>
#include <type_traits>

namespace tvm {
namespace support {

class Stream {
 public:
  virtual ~Stream() = default;
  /*! \brief read up to size bytes into ptr; returns the bytes read */
  virtual size_t Read(void* ptr, size_t size) = 0;
  /*! \brief write size bytes from ptr */
  virtual size_t Write(const void* ptr, size_t size) = 0;

  template <typename T>
  void Write(const T& value) {
    static_assert(std::is_trivially_copyable<T>::value, "tvmkv's Stream writes plain values only");
    Write(&value, sizeof(T));
  }
  template <typename T>
  bool Read(T* value) {
    static_assert(std::is_trivially_copyable<T>::value, "tvmkv's Stream reads plain values only");
    return Read(static_cast<void*>(value), sizeof(T)) == sizeof(T);
  }
  template <typename T>
  void WriteArray(const T* data, size_t n) {
    for (size_t i = 0; i < n; ++i) Write(data[i]);
  }
  template <typename T>
  bool ReadArray(T* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (!Read(data + i)) return false;
    }
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#endif  // TVMKV_DISCO_SUPPORT_IO_H_
