// Symbol visibility for the installed shardcoord libraries. They are built with
// -fvisibility=hidden because they are loaded into other people's processes; only
// declarations marked SHARDCOORD_EXPORT are part of the binary interface.
#ifndef SHARDCOORD_EXPORT_H_
#define SHARDCOORD_EXPORT_H_

#if defined(_WIN32)
#define SHARDCOORD_EXPORT
#else
#define SHARDCOORD_EXPORT __attribute__((visibility("default")))
#endif

#endif  // SHARDCOORD_EXPORT_H_
