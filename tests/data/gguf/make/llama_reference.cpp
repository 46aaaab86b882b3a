// What llama.cpp computes on one GGUF file, written down for this project's GGUF tests.
//
//   llama_reference MODEL.gguf REQUESTS.json OUT_STEM [--threads N] [--verbose]
//                   [--override-kv KEY=int:N|float:X|bool:true|str:S ...]
//
// --override-kv is llama.cpp's own loading option (llama_model_params.kv_overrides): it
// changes what the loader reads, not the file. The JSON records any that were given.
//
// REQUESTS.json (written by make_gguf_fixtures.sh):
//   {"prompts": [{"name": "p0", "ids": [1, 2, 3], "greedy": 16, "logits": "all"}, ...],
//    "texts":   ["Hello world", ...]}
//   "logits": "all"      -> NAME.logits F32 [T, n_vocab], every position of one llama_decode
//             "summary"  -> NAME.nll F32 [T-1] (-log p of the next prompt token), NAME.argmax
//                           I64 [T], NAME.logsumexp F32 [T], NAME.logits_head F32 [min(T,32), V],
//                           NAME.logits_tail F32 [min(T,32), V] (the last positions)
//   "greedy": N          -> NAME.greedy_ids I64 [N], NAME.greedy_margin F32 [N] (top-1 minus
//                           top-2 logit at each step): argmax decoding with the KV cache in a
//                           fresh context, one token per llama_decode after the prompt
//   always               -> NAME.input_ids I64 [T]
// Writes OUT_STEM.llama.safetensors (the tensors above) and OUT_STEM.llama.json: settings,
// llama.cpp's view of the model (metadata, special tokens), per prompt the greedy text, and
// per text its tokenisations with llama_tokenize and what llama_detokenize gives back.
//
// Everything runs on the CPU in one context per request: n_batch = n_ubatch >= T (one
// ubatch, so one graph for the whole prompt), F32 K/V cache, flash attention off, a fixed
// thread count. Built against llama.h of the llama.cpp commit named in ../README.md.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---------------------------------------------------------------- a small JSON reader
struct Json {
    enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
    bool b = false;
    double num = 0;
    std::string str;
    std::vector<Json> arr;
    std::vector<std::pair<std::string, Json>> obj;

    const Json * get(const std::string & key) const {
        for (const auto & kv : obj) {
            if (kv.first == key) return &kv.second;
        }
        return nullptr;
    }
};

class JsonParser {
public:
    explicit JsonParser(const std::string & text) : s_(text) {}

    Json parse() {
        Json v = value();
        ws();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

private:
    const std::string & s_;
    size_t i_ = 0;

    [[noreturn]] void fail(const char * what) const {
        throw std::runtime_error(std::string("requests JSON: ") + what + " at byte " + std::to_string(i_));
    }
    void ws() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
    }
    char peek() {
        ws();
        if (i_ >= s_.size()) fail("unexpected end");
        return s_[i_];
    }
    void expect(char c) {
        if (peek() != c) fail("unexpected character");
        ++i_;
    }
    bool literal(const char * word) {
        const size_t n = std::strlen(word);
        if (s_.compare(i_, n, word) == 0) {
            i_ += n;
            return true;
        }
        return false;
    }
    Json value() {
        const char c = peek();
        Json v;
        if (c == '{') {
            v.kind = Json::Object;
            ++i_;
            if (peek() == '}') { ++i_; return v; }
            for (;;) {
                if (peek() != '"') fail("expected a key");
                std::string key = string();
                expect(':');
                v.obj.emplace_back(std::move(key), value());
                const char d = peek();
                ++i_;
                if (d == '}') break;
                if (d != ',') fail("expected , or }");
            }
        } else if (c == '[') {
            v.kind = Json::Array;
            ++i_;
            if (peek() == ']') { ++i_; return v; }
            for (;;) {
                v.arr.push_back(value());
                const char d = peek();
                ++i_;
                if (d == ']') break;
                if (d != ',') fail("expected , or ]");
            }
        } else if (c == '"') {
            v.kind = Json::String;
            v.str = string();
        } else if (literal("true")) {
            v.kind = Json::Bool;
            v.b = true;
        } else if (literal("false")) {
            v.kind = Json::Bool;
        } else if (literal("null")) {
            v.kind = Json::Null;
        } else {
            v.kind = Json::Number;
            const char * begin = s_.c_str() + i_;
            char * end = nullptr;
            v.num = std::strtod(begin, &end);
            if (end == begin) fail("bad value");
            i_ += size_t(end - begin);
        }
        return v;
    }
    static void put_utf8(std::string & out, uint32_t cp) {
        if (cp < 0x80) {
            out += char(cp);
        } else if (cp < 0x800) {
            out += char(0xC0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += char(0xE0 | (cp >> 12));
            out += char(0x80 | ((cp >> 6) & 0x3F));
            out += char(0x80 | (cp & 0x3F));
        } else {
            out += char(0xF0 | (cp >> 18));
            out += char(0x80 | ((cp >> 12) & 0x3F));
            out += char(0x80 | ((cp >> 6) & 0x3F));
            out += char(0x80 | (cp & 0x3F));
        }
    }
    uint32_t hex4() {
        if (i_ + 4 > s_.size()) fail("short \\u escape");
        uint32_t v = 0;
        for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            v <<= 4;
            if (h >= '0' && h <= '9') v |= uint32_t(h - '0');
            else if (h >= 'a' && h <= 'f') v |= uint32_t(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') v |= uint32_t(h - 'A' + 10);
            else fail("bad \\u escape");
        }
        return v;
    }
    std::string string() {
        expect('"');
        std::string out;
        for (;;) {
            if (i_ >= s_.size()) fail("unterminated string");
            const char c = s_[i_++];
            if (c == '"') break;
            if (c != '\\') { out += c; continue; }
            if (i_ >= s_.size()) fail("unterminated escape");
            const char e = s_[i_++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t cp = hex4();
                    if (cp >= 0xD800 && cp < 0xDC00 && i_ + 1 < s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
                        i_ += 2;
                        const uint32_t lo = hex4();
                        if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    }
                    put_utf8(out, cp);
                    break;
                }
                default: fail("bad escape");
            }
        }
        return out;
    }
};

// ---------------------------------------------------------------- JSON writing helpers
// Length of the valid UTF-8 sequence at s[i], or 0 when the bytes there are not one.
size_t utf8_len(const std::string & s, size_t i) {
    const auto u = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = u(i);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) { n = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { n = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { n = 4; cp = c & 0x07; }
    else return 0;
    if (i + n > s.size()) return 0;
    for (size_t k = 1; k < n; ++k) {
        if ((u(i + k) & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (u(i + k) & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp < 0xE000)) {
        return 0;
    }
    return n;
}

bool valid_utf8(const std::string & s) {
    for (size_t i = 0; i < s.size();) {
        const size_t n = utf8_len(s, i);
        if (n == 0) return false;
        i += n;
    }
    return true;
}

// A JSON string literal; bytes that are not valid UTF-8 become U+FFFD (the caller also
// writes the bytes in hex where that can happen).
std::string jstr(const std::string & s) {
    std::string out = "\"";
    char buf[8];
    for (size_t i = 0; i < s.size();) {
        const size_t n = utf8_len(s, i);
        if (n == 0) {
            out += "\\ufffd";
            ++i;
            continue;
        }
        if (n > 1) {
            out.append(s, i, n);
            i += n;
            continue;
        }
        const unsigned char c = static_cast<unsigned char>(s[i++]);
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (c < 0x20 || c == 0x7F) {
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
                    out += buf;
                } else {
                    out += char(c);
                }
        }
    }
    return out + "\"";
}

std::string hex(const std::string & s) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (const unsigned char c : s) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

template <typename T> std::string jlist(const std::vector<T> & v) {
    std::ostringstream o;
    o << '[';
    for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
    o << ']';
    return o.str();
}

// ---------------------------------------------------------------- safetensors writer
class Safetensors {
public:
    void add_f32(const std::string & name, std::vector<int64_t> shape, const std::vector<float> & v) {
        add(name, "F32", std::move(shape), v.data(), v.size() * sizeof(float));
    }
    void add_i64(const std::string & name, std::vector<int64_t> shape, const std::vector<int64_t> & v) {
        add(name, "I64", std::move(shape), v.data(), v.size() * sizeof(int64_t));
    }
    void write(const std::string & path, const std::map<std::string, std::string> & metadata) const {
        std::string header = "{";
        bool first = true;
        if (!metadata.empty()) {
            header += "\"__metadata__\": {";
            for (auto it = metadata.begin(); it != metadata.end(); ++it) {
                header += (it == metadata.begin() ? "" : ", ") + jstr(it->first) + ": " + jstr(it->second);
            }
            header += "}";
            first = false;
        }
        for (const auto & e : entries_) {
            header += (first ? "" : ", ") + jstr(e.name) + ": {\"dtype\": \"" + e.dtype + "\", \"shape\": " +
                      jlist(e.shape) + ", \"data_offsets\": [" + std::to_string(e.begin) + ", " +
                      std::to_string(e.end) + "]}";
            first = false;
        }
        header += "}";
        while (header.size() % 8 != 0) header += ' ';
        std::ofstream f(path, std::ios::binary);
        if (!f) throw std::runtime_error("cannot write " + path);
        const uint64_t n = header.size();
        unsigned char len[8];
        for (int k = 0; k < 8; ++k) len[k] = static_cast<unsigned char>(n >> (8 * k));  // little-endian
        f.write(reinterpret_cast<const char *>(len), 8);
        f.write(header.data(), std::streamsize(header.size()));
        f.write(data_.data(), std::streamsize(data_.size()));
        if (!f) throw std::runtime_error("short write to " + path);
    }

private:
    struct Entry {
        std::string name, dtype;
        std::vector<int64_t> shape;
        size_t begin, end;
    };
    std::vector<Entry> entries_;
    std::string data_;

    void add(const std::string & name, const char * dtype, std::vector<int64_t> shape, const void * p, size_t bytes) {
        const size_t begin = data_.size();
        data_.append(static_cast<const char *>(p), bytes);  // the host is little-endian (x86-64)
        entries_.push_back({name, dtype, std::move(shape), begin, data_.size()});
    }
};

// ---------------------------------------------------------------- llama.cpp
bool g_verbose = false;

void log_cb(ggml_log_level level, const char * text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

struct ContextDeleter {
    void operator()(llama_context * c) const { llama_free(c); }
};
using Context = std::unique_ptr<llama_context, ContextDeleter>;

struct Runner {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    int n_vocab = 0;
    int threads = 4;

    Context context(int n_tokens) const {
        llama_context_params p = llama_context_default_params();
        const uint32_t need = uint32_t(n_tokens) + 16;
        p.n_ctx = (need + 255) / 256 * 256;
        p.n_batch = std::max<uint32_t>(uint32_t(n_tokens), 32);
        p.n_ubatch = p.n_batch;
        p.n_seq_max = 1;
        p.n_threads = threads;
        p.n_threads_batch = threads;
        p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        p.type_k = GGML_TYPE_F32;
        p.type_v = GGML_TYPE_F32;
        p.no_perf = true;
        llama_context * c = llama_init_from_model(model, p);
        if (c == nullptr) throw std::runtime_error("llama_init_from_model failed");
        return Context(c);
    }

    // One llama_decode of `ids` at positions start.., logits wanted where want[i].
    static void decode(llama_context * c, const std::vector<llama_token> & ids, int start, bool all_logits) {
        llama_batch b = llama_batch_init(int32_t(ids.size()), 0, 1);
        b.n_tokens = int32_t(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
            b.token[i] = ids[i];
            b.pos[i] = start + int(i);
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = (all_logits || i + 1 == ids.size()) ? 1 : 0;
        }
        const int32_t rc = llama_decode(c, b);
        llama_batch_free(b);
        if (rc != 0) throw std::runtime_error("llama_decode returned " + std::to_string(rc));
    }

    std::vector<float> all_logits(const std::vector<llama_token> & ids) const {
        Context c = context(int(ids.size()));
        decode(c.get(), ids, 0, true);
        std::vector<float> out(ids.size() * size_t(n_vocab));
        for (size_t i = 0; i < ids.size(); ++i) {
            const float * l = llama_get_logits_ith(c.get(), int32_t(i));
            if (l == nullptr) throw std::runtime_error("no logits for position " + std::to_string(i));
            std::memcpy(out.data() + i * size_t(n_vocab), l, sizeof(float) * size_t(n_vocab));
        }
        return out;
    }

    // Argmax (lowest id on ties) and the margin to the runner-up.
    std::pair<llama_token, float> top(const float * l) const {
        int best = 0;
        for (int v = 1; v < n_vocab; ++v) {
            if (l[v] > l[best]) best = v;
        }
        float second = -INFINITY;
        for (int v = 0; v < n_vocab; ++v) {
            if (v != best && l[v] > second) second = l[v];
        }
        return {llama_token(best), l[best] - second};
    }

    void greedy(const std::vector<llama_token> & prompt, int n, std::vector<int64_t> & ids, std::vector<float> & margins) const {
        Context c = context(int(prompt.size()) + n);
        decode(c.get(), prompt, 0, false);
        int pos = int(prompt.size());
        for (int k = 0; k < n; ++k) {
            const auto [tok, margin] = top(llama_get_logits_ith(c.get(), -1));
            ids.push_back(tok);
            margins.push_back(margin);
            if (k + 1 < n) decode(c.get(), {tok}, pos++, false);
        }
    }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const {
        std::vector<llama_token> out(text.size() + 8);
        int32_t n = llama_tokenize(vocab, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), add_special, parse_special);
        if (n < 0) {
            out.resize(size_t(-n));
            n = llama_tokenize(vocab, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), add_special, parse_special);
        }
        if (n < 0) throw std::runtime_error("llama_tokenize failed");
        out.resize(size_t(n));
        return out;
    }

    std::string detokenize(const std::vector<llama_token> & ids, bool remove_special, bool unparse_special) const {
        std::string out(ids.size() * 16 + 16, '\0');
        int32_t n = llama_detokenize(vocab, ids.data(), int32_t(ids.size()), out.data(), int32_t(out.size()), remove_special, unparse_special);
        if (n < 0) {
            out.resize(size_t(-n));
            n = llama_detokenize(vocab, ids.data(), int32_t(ids.size()), out.data(), int32_t(out.size()), remove_special, unparse_special);
        }
        if (n < 0) throw std::runtime_error("llama_detokenize failed");
        out.resize(size_t(n));
        return out;
    }

    std::string piece(llama_token id) const {
        std::string out(64, '\0');
        int32_t n = llama_token_to_piece(vocab, id, out.data(), int32_t(out.size()), 0, true);
        if (n < 0) {
            out.resize(size_t(-n));
            n = llama_token_to_piece(vocab, id, out.data(), int32_t(out.size()), 0, true);
        }
        out.resize(size_t(std::max(n, 0)));
        return out;
    }
};

std::string read_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read " + path);
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
}

// KEY=TYPE:VALUE, as llama.cpp's tools spell it.
llama_model_kv_override parse_override(const std::string & arg) {
    llama_model_kv_override o{};
    const size_t eq = arg.find('='), colon = arg.find(':', eq == std::string::npos ? 0 : eq);
    if (eq == std::string::npos || colon == std::string::npos || eq >= sizeof o.key) {
        throw std::runtime_error("bad --override-kv " + arg);
    }
    std::memcpy(o.key, arg.data(), eq);
    const std::string type = arg.substr(eq + 1, colon - eq - 1), value = arg.substr(colon + 1);
    if (type == "int") { o.tag = LLAMA_KV_OVERRIDE_TYPE_INT; o.val_i64 = std::stoll(value); }
    else if (type == "float") { o.tag = LLAMA_KV_OVERRIDE_TYPE_FLOAT; o.val_f64 = std::stod(value); }
    else if (type == "bool") { o.tag = LLAMA_KV_OVERRIDE_TYPE_BOOL; o.val_bool = value == "true"; }
    else if (type == "str" && value.size() < sizeof o.val_str) {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_STR;
        std::memcpy(o.val_str, value.data(), value.size());
    } else throw std::runtime_error("bad --override-kv " + arg);
    return o;
}

std::vector<int64_t> widen(const std::vector<llama_token> & v) { return {v.begin(), v.end()}; }

// The text fields of a tokenisation: the string, plus its bytes in hex when it is not UTF-8.
std::string text_fields(const std::string & key, const std::string & s) {
    std::string out = jstr(key) + ": " + jstr(s);
    if (!valid_utf8(s)) out += ", " + jstr(key + "_hex") + ": " + jstr(hex(s));
    return out;
}

int run(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf REQUESTS.json OUT_STEM [--threads N] [--verbose] [--override-kv K=T:V]\n", argv[0]);
        return 2;
    }
    const std::string model_path = argv[1], requests_path = argv[2], stem = argv[3];
    Runner r;
    std::vector<llama_model_kv_override> overrides;
    std::vector<std::string> override_args;
    for (int i = 4; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--threads" && i + 1 < argc) r.threads = std::atoi(argv[++i]);
        else if (a == "--verbose") g_verbose = true;
        else if (a == "--override-kv" && i + 1 < argc) {
            override_args.push_back(argv[++i]);
            overrides.push_back(parse_override(override_args.back()));
        } else throw std::runtime_error("unknown argument " + a);
    }
    const Json req = JsonParser(read_file(requests_path)).parse();

    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    if (!overrides.empty()) {
        overrides.emplace_back();
        overrides.back().key[0] = 0;  // the list ends with an empty key
        mp.kv_overrides = overrides.data();
    }
    r.model = llama_model_load_from_file(model_path.c_str(), mp);
    if (r.model == nullptr) throw std::runtime_error("llama_model_load_from_file failed for " + model_path);
    r.vocab = llama_model_get_vocab(r.model);
    r.n_vocab = llama_vocab_n_tokens(r.vocab);

    Safetensors st;
    std::ostringstream js;
    char desc[256] = {0};
    llama_model_desc(r.model, desc, sizeof desc);
    js << "{\n  \"model\": " << jstr(model_path.substr(model_path.find_last_of('/') + 1)) << ",\n"
       << "  \"llama_model_desc\": " << jstr(desc) << ",\n"
       << "  \"n_params\": " << llama_model_n_params(r.model) << ",\n"
       << "  \"n_vocab\": " << r.n_vocab << ",\n"
       << "  \"vocab_type\": " << int(llama_vocab_type(r.vocab)) << ",\n"
       << "  \"special\": {\"bos\": " << llama_vocab_bos(r.vocab) << ", \"eos\": " << llama_vocab_eos(r.vocab)
       << ", \"eot\": " << llama_vocab_eot(r.vocab) << ", \"pad\": " << llama_vocab_pad(r.vocab)
       << ", \"nl\": " << llama_vocab_nl(r.vocab) << ", \"add_bos\": " << (llama_vocab_get_add_bos(r.vocab) ? "true" : "false")
       << ", \"add_eos\": " << (llama_vocab_get_add_eos(r.vocab) ? "true" : "false") << "},\n"
       << "  \"kv_overrides\": [";
    for (size_t i = 0; i < override_args.size(); ++i) js << (i ? ", " : "") << jstr(override_args[i]);
    js << "],\n"
       << "  \"settings\": {\"device\": \"CPU\", \"n_threads\": " << r.threads
       << ", \"flash_attn\": false, \"kv_cache\": \"F32\", \"one_ubatch_per_prompt\": true, \"system_info\": "
       << jstr(llama_print_system_info()) << "},\n";

    // llama.cpp's own view of the metadata (arrays are summarised by llama.cpp).
    js << "  \"metadata\": {";
    const int32_t n_meta = llama_model_meta_count(r.model);
    std::vector<char> kbuf(512), vbuf(1 << 16);
    for (int32_t i = 0; i < n_meta; ++i) {
        llama_model_meta_key_by_index(r.model, i, kbuf.data(), kbuf.size());
        llama_model_meta_val_str_by_index(r.model, i, vbuf.data(), vbuf.size());
        js << (i ? ",\n    " : "\n    ") << jstr(kbuf.data()) << ": " << jstr(vbuf.data());
    }
    js << "\n  },\n";

    js << "  \"prompts\": [";
    const Json * prompts = req.get("prompts");
    bool first_prompt = true;
    for (const Json & p : prompts ? prompts->arr : std::vector<Json>{}) {
        const std::string name = p.get("name")->str;
        std::vector<llama_token> ids;
        for (const Json & v : p.get("ids")->arr) ids.push_back(llama_token(v.num));
        const Json * g = p.get("greedy");
        const int n_greedy = g ? int(g->num) : 0;
        const Json * lk = p.get("logits");
        const std::string mode = lk ? lk->str : "all";
        const int64_t T = int64_t(ids.size()), V = r.n_vocab;
        std::fprintf(stderr, "llama_reference: %s: %s, %lld tokens, logits %s, %d greedy\n", stem.c_str(), name.c_str(),
                     (long long)T, mode.c_str(), n_greedy);

        st.add_i64(name + ".input_ids", {T}, widen(ids));
        if (T > 0 && mode != "none") {
            const std::vector<float> logits = r.all_logits(ids);
            if (mode == "all") {
                st.add_f32(name + ".logits", {T, V}, logits);
            } else {
                std::vector<float> nll, lse;
                std::vector<int64_t> amax;
                for (int64_t t = 0; t < T; ++t) {
                    const float * l = logits.data() + t * V;
                    double m = l[0];
                    int64_t best = 0;
                    for (int64_t v = 1; v < V; ++v) {
                        if (l[v] > l[best]) best = v;
                        m = std::max(m, double(l[v]));
                    }
                    double s = 0;
                    for (int64_t v = 0; v < V; ++v) s += std::exp(double(l[v]) - m);
                    const double z = m + std::log(s);
                    lse.push_back(float(z));
                    amax.push_back(best);
                    if (t + 1 < T) nll.push_back(float(z - double(l[ids[size_t(t + 1)]])));
                }
                const int64_t k = std::min<int64_t>(T, 32);
                st.add_f32(name + ".nll", {T - 1}, nll);
                st.add_i64(name + ".argmax", {T}, amax);
                st.add_f32(name + ".logsumexp", {T}, lse);
                st.add_f32(name + ".logits_head", {k, V}, std::vector<float>(logits.begin(), logits.begin() + k * V));
                st.add_f32(name + ".logits_tail", {k, V}, std::vector<float>(logits.end() - k * V, logits.end()));
            }
        }
        std::string greedy_text;
        if (n_greedy > 0 && T > 0) {
            std::vector<int64_t> gids;
            std::vector<float> margins;
            r.greedy(ids, n_greedy, gids, margins);
            st.add_i64(name + ".greedy_ids", {int64_t(gids.size())}, gids);
            st.add_f32(name + ".greedy_margin", {int64_t(margins.size())}, margins);
            greedy_text = r.detokenize(std::vector<llama_token>(gids.begin(), gids.end()), false, true);
        }
        js << (first_prompt ? "\n    " : ",\n    ") << "{\"name\": " << jstr(name) << ", \"n_tokens\": " << T
           << ", \"logits\": " << jstr(mode) << ", \"n_greedy\": " << n_greedy << ", "
           << text_fields("greedy_text", greedy_text) << "}";
        first_prompt = false;
    }
    js << "\n  ],\n";

    // Tokenisation: as a user would call it (add_special, no special-token parsing), plain
    // (neither), and with special tokens in the text recognised (what HF tokenizers do).
    js << "  \"tokenisations\": [";
    const Json * texts = req.get("texts");
    bool first_text = true;
    for (const Json & t : texts ? texts->arr : std::vector<Json>{}) {
        const std::string & text = t.str;
        const auto ids_special = r.tokenize(text, true, false);
        const auto ids_plain = r.tokenize(text, false, false);
        const auto ids_parse = r.tokenize(text, false, true);
        std::string pieces;
        for (size_t i = 0; i < ids_parse.size(); ++i) pieces += (i ? ", " : "") + jstr(hex(r.piece(ids_parse[i])));
        js << (first_text ? "\n    " : ",\n    ") << "{" << text_fields("text", text)
           << ",\n     \"ids_special\": " << jlist(ids_special)
           << ",\n     \"ids_plain\": " << jlist(ids_plain)
           << ",\n     \"ids_parse\": " << jlist(ids_parse)
           << ",\n     " << text_fields("detok", r.detokenize(ids_plain, false, false))
           << ",\n     " << text_fields("detok_special_removed", r.detokenize(ids_special, true, false))
           << ",\n     " << text_fields("detok_parse", r.detokenize(ids_parse, false, true))
           << ",\n     \"pieces_parse_hex\": [" << pieces << "]}";
        first_text = false;
    }
    js << "\n  ]\n}\n";

    st.write(stem + ".llama.safetensors", {{"model", model_path.substr(model_path.find_last_of('/') + 1)},
                                           {"producer", "tests/data/gguf/make/llama_reference.cpp"}});
    std::ofstream jf(stem + ".llama.json", std::ios::binary);
    jf << js.str();
    if (!jf) throw std::runtime_error("cannot write " + stem + ".llama.json");

    llama_model_free(r.model);
    llama_backend_free();
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "llama_reference: error: %s\n", e.what());
        return 1;
    }
}
