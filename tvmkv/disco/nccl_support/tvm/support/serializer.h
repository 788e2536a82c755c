/*
 * tvmkv's stand-in (see io.h beside it): <tvm/runtime/tensor.h> includes this header but needs
 * nothing from it beyond io.h's typed reads and writes.
 */
#ifndef TVMKV_DISCO_SUPPORT_SERIALIZER_H_
#define TVMKV_DISCO_SUPPORT_SERIALIZER_H_

#include "io.h"

#endif  // TVMKV_DISCO_SUPPORT_SERIALIZER_H_
